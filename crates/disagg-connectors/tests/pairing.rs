//! Pairing facts (`disagg_pairing`) against the engines' connectors: which
//! versions, roles, connectors and tensor-parallel sizes each protocol can pair.
#![cfg(all(feature = "vllm", feature = "sglang"))]

use disagg_connectors::sglang::SglangBootstrap;
use disagg_connectors::vllm::{VllmMooncake, VllmNixl};
use disagg_core::connector::KvConnector;
use disagg_pairing::{KvProfile, KvRole, Mismatch, check_pair};
use disagg_resilience::pairing::check_versions;

#[test]
fn versions_are_checked_for_nixl_and_mooncake_only_when_both_are_known() {
    let nixl = VllmNixl::new();
    let err = check_versions(Some("0.33.0"), Some("0.32.1"), &nixl).unwrap_err();
    assert_eq!(err.kind(), "version");
    let text = err.to_string();
    assert!(text.contains("0.33.0") && text.contains("0.32.1"), "{text}");
    assert!(check_versions(Some("0.33.0"), Some("0.33.0"), &nixl).is_ok());
    assert!(check_versions(None, Some("0.32.1"), &nixl).is_ok());
    assert!(check_versions(Some("0.33.0"), None, &nixl).is_ok());
    assert!(check_versions(Some("a"), Some("b"), &VllmMooncake::new()).is_err());
    assert!(check_versions(Some("a"), Some("b"), &SglangBootstrap::new()).is_ok());
}

fn profile(connector: Option<&str>, role: Option<KvRole>, tp: Option<u32>) -> KvProfile {
    KvProfile {
        connector: connector.map(str::to_owned),
        role,
        tp_size: tp,
    }
}

#[test]
fn undeclared_profiles_pass() {
    let nixl = VllmNixl::new();
    assert_eq!(
        check_pair(&KvProfile::default(), &KvProfile::default(), &nixl),
        Ok(())
    );
    let ok = profile(Some("NixlConnector"), Some(KvRole::Both), Some(4));
    assert_eq!(check_pair(&ok, &ok, &nixl), Ok(()));
}

#[test]
fn each_mismatch_is_named() {
    let nixl = VllmNixl::new();
    let c = |p, d| check_pair(&p, &d, &nixl).unwrap_err();
    assert!(matches!(
        c(
            profile(Some("NixlConnector"), None, None),
            profile(Some("MooncakeConnector"), None, None)
        ),
        Mismatch::Connectors { .. }
    ));
    assert!(matches!(
        c(
            profile(Some("sglang"), None, None),
            profile(Some("sglang"), None, None)
        ),
        Mismatch::NotTheProxys { leg: "prefill", .. }
    ));
    assert_eq!(
        c(
            profile(None, Some(KvRole::Consumer), None),
            KvProfile::default()
        ),
        Mismatch::PrefillRole(KvRole::Consumer)
    );
    assert_eq!(
        c(
            KvProfile::default(),
            profile(None, Some(KvRole::Producer), None)
        ),
        Mismatch::DecodeRole(KvRole::Producer)
    );
    assert!(matches!(
        c(profile(None, None, Some(4)), profile(None, None, Some(6))),
        Mismatch::TpSize {
            prefill: 4,
            decode: 6,
            ..
        }
    ));
}

#[test]
fn tp_bridging_is_the_connectors_call() {
    let tp = |p, d, c: &dyn KvConnector| {
        check_pair(
            &profile(None, None, Some(p)),
            &profile(None, None, Some(d)),
            c,
        )
        .is_ok()
    };
    // NIXL maps ranks by the size ratio: one size must divide the other.
    assert!(tp(2, 8, &VllmNixl::new()));
    assert!(tp(8, 2, &VllmNixl::new()));
    assert!(!tp(4, 6, &VllmNixl::new()));
    // The others are taken at equal sizes only.
    assert!(tp(4, 4, &VllmMooncake::new()));
    assert!(!tp(2, 4, &VllmMooncake::new()));
    assert!(!tp(2, 4, &SglangBootstrap::new()));
}
