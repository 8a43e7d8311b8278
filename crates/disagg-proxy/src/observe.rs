//! `serve`'s observability flags: the metrics every proxy records, OpenTelemetry traces
//! (`--otlp-endpoint`, `--trace-ratio`) and the access log (`--access-log`).
//!
//! The metrics ([`Metrics`], each endpoint's health) are always on: `GET /metrics`
//! serves them. Traces cost nothing unless an endpoint is given (by flag or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`): without one the orchestrator draws no trace ids and
//! no span is made. The access log is off unless asked for.

use clap::{Args, ValueEnum};
use disagg_core::orchestrator::OrchestratorBuilder;
use disagg_core::orchestrator::OrchestratorConfig;
use disagg_http::PdServiceConfig;
use disagg_http::access_log::{AccessLog, AccessLogFormat, AccessLogWriter};
use disagg_http::metrics::{ExtraMetrics, Metrics};
use disagg_otel::{OtlpConfig, Tracer};

use crate::BoxError;

/// Metrics, traces and the access log.
#[derive(Debug, Clone, Args)]
pub struct ObserveArgs {
    /// Export OpenTelemetry traces over OTLP/HTTP (protobuf) to URL/v1/traces (e.g.
    /// http://otel-collector:4318). Default: $OTEL_EXPORTER_OTLP_ENDPOINT; neither: no
    /// tracing. The service name is $OTEL_SERVICE_NAME, else disagg-proxy.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
    /// The share of requests traced (0 to 1) when their client sent no sampled
    /// traceparent; a client's decision (its traceparent's sampled flag) is followed.
    #[arg(long, value_name = "RATIO", default_value_t = 1.0)]
    trace_ratio: f64,
    /// Write one line per request to stdout when it ends: json, or text (key=value).
    #[arg(long, value_enum, value_name = "FORMAT")]
    access_log: Option<AccessLogArg>,
}

/// `--access-log`'s formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccessLogArg {
    /// One JSON object per line.
    Json,
    /// Time, method, path and status, then key=value pairs.
    Text,
}

/// What [`ObserveArgs::start`] set up: the listeners to attach and what to close at
/// shutdown.
#[derive(Debug)]
pub(crate) struct Observe {
    metrics: Metrics,
    tracer: Option<Tracer>,
    access_log: Option<AccessLog>,
    /// Closed by [`Finish::close`].
    finish: Finish,
}

/// What must be flushed when the proxy stops: the access log's last lines, the last
/// spans.
#[derive(Debug, Default)]
pub(crate) struct Finish {
    writer: Option<AccessLogWriter>,
    tracer: Option<Tracer>,
}

impl Finish {
    /// Write the queued log lines and export the queued spans.
    pub(crate) fn close(self) {
        if let Some(writer) = self.writer {
            writer.close();
        }
        if let Some(tracer) = self.tracer {
            tracer.shutdown();
        }
    }
}

impl ObserveArgs {
    /// `--otlp-endpoint`, if given.
    pub(crate) fn otlp_endpoint(&self) -> Option<&str> {
        self.otlp_endpoint.as_deref()
    }

    /// Start what the flags ask for, for an orchestrator whose connector is named
    /// `connector`; sets `config.trace_ratio` when tracing.
    pub(crate) fn start(
        &self,
        connector: &'static str,
        config: &mut OrchestratorConfig,
    ) -> Result<Observe, BoxError> {
        if !(0.0..=1.0).contains(&self.trace_ratio) {
            return Err("--trace-ratio must be between 0 and 1".into());
        }
        let tracer = match OtlpConfig::from_flag_or_env(self.otlp_endpoint.as_deref()) {
            Some(otlp) => {
                let url = otlp.traces_url();
                let tracer = Tracer::otlp(otlp)
                    .map_err(|e| format!("--otlp-endpoint: {e}"))?
                    .with_connector(connector);
                tracing::info!(%url, ratio = self.trace_ratio, "exporting traces");
                config.trace_ratio = Some(self.trace_ratio);
                Some(tracer)
            }
            None => None,
        };
        let (access_log, writer) = match self.access_log {
            Some(format) => {
                let format = match format {
                    AccessLogArg::Json => AccessLogFormat::Json,
                    AccessLogArg::Text => AccessLogFormat::Text,
                };
                let (log, writer) = AccessLog::stdout(format)?;
                (Some(log), Some(writer))
            }
            None => (None, None),
        };
        Ok(Observe {
            metrics: Metrics::new(connector),
            finish: Finish {
                writer,
                tracer: tracer.clone(),
            },
            tracer,
            access_log,
        })
    }
}

impl Observe {
    /// `builder` with the metrics, tracer and access log listening.
    pub(crate) fn attach(&self, mut builder: OrchestratorBuilder) -> OrchestratorBuilder {
        builder = builder.listener(self.metrics.clone());
        if let Some(tracer) = &self.tracer {
            builder = builder.listener(tracer.clone());
        }
        if let Some(log) = &self.access_log {
            builder = builder.listener(log.clone());
        }
        builder
    }

    /// `GET /metrics` with the request metrics and the access log's; the metrics, the
    /// tracer and the access log hear the requests the orchestrator does not serve.
    pub(crate) fn serve_metrics(&self, service: &mut PdServiceConfig) {
        service.metrics = Some(self.metrics.clone());
        service.route_listeners.push(self.metrics.clone());
        if let Some(tracer) = &self.tracer {
            service.route_listeners.push(tracer.clone());
        }
        if let Some(log) = &self.access_log {
            service.route_listeners.push(log.clone());
        }
        if let Some(log) = self.access_log.clone() {
            service
                .extra_metrics
                .push(ExtraMetrics::new(move |registry| {
                    log.register_metrics(registry)
                }));
        }
    }

    /// What to close at shutdown.
    pub(crate) fn into_finish(self) -> Finish {
        self.finish
    }
}

/// Encode each `(name, help, value)` as an unlabelled counter (named without `_total`:
/// the encoders append it), for the proxy's collectors that read their counters at
/// each scrape.
pub(crate) fn encode_counters(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    counters: &[(&str, &str, u64)],
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::MetricType;
    use prometheus_client::metrics::counter::ConstCounter;
    for &(name, help, value) in counters {
        let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        ConstCounter::new(value).encode(family)?;
    }
    Ok(())
}
