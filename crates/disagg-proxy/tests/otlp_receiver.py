"""An OTLP/HTTP trace receiver for the trace tests (crates/disagg-proxy/tests/observe.rs).

Listens on 127.0.0.1 (a free port, printed first as `PORT <n>`), accepts
`POST /v1/traces` with an `application/x-protobuf` body, decodes it with the
OpenTelemetry project's own protobuf bindings (`opentelemetry-proto`) and prints one
JSON line per span:

    {"service": ..., "trace_id": hex, "span_id": hex, "parent_span_id": hex or "",
     "name": ..., "kind": int, "start": ns, "end": ns, "status": int,
     "attributes": {key: value}, "events": [name, ...], "flags": int}

Answers 200 with an empty ExportTraceServiceResponse, as a collector does.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    print(json.dumps({
                        "service": resource.get("service.name"),
                        "scope": ss.scope.name,
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent_span_id": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "status": s.status.code,
                        "attributes": {a.key: value(a.value) for a in s.attributes},
                        "events": [e.name for e in s.events],
                        "flags": s.flags,
                    }), flush=True)
        out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


server = HTTPServer(("127.0.0.1", 0), Handler)
print(f"PORT {server.server_address[1]}", flush=True)
server.serve_forever()
