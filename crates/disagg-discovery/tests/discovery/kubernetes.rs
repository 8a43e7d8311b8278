//! Kubernetes discovery.
