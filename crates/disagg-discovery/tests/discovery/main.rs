//! Discovery tests: the merged source, the endpoints file, DNS against a real dnsmasq,
//! and Kubernetes through kube-rs's real client against an in-test API server.

mod apiserver;
mod churn;
mod dns;
mod file;
mod kubernetes;
mod manifests;
mod merge;
mod support;
