//! Unit tests of `endpoint`.

use super::*;

#[test]
fn parses_base_urls() {
    let ep = Endpoint::new("http://127.0.0.1:8000/", Role::Decode).unwrap();
    assert_eq!(ep.id().as_str(), "http://127.0.0.1:8000");
    assert_eq!(ep.authority().as_str(), "127.0.0.1:8000");
    assert_eq!(
        ep.uri("/v1/completions").unwrap().to_string(),
        "http://127.0.0.1:8000/v1/completions"
    );
    assert!(Endpoint::new("http://h:1/v1", Role::Decode).is_err());
    let tls = Endpoint::new("https://h:1", Role::Decode).unwrap();
    assert_eq!(
        tls.uri("/health").unwrap().to_string(),
        "https://h:1/health"
    );
    assert!(Endpoint::new("ftp://h:1", Role::Decode).is_err());
    assert!(Endpoint::new("h:1", Role::Decode).is_err());
    assert!(Endpoint::new("not a url", Role::Decode).is_err());
}

#[test]
fn a_rank_endpoint_counts_towards_its_engine() {
    let engine = Arc::new(Endpoint::new("http://10.0.0.5:8100", Role::Prefill).unwrap());
    let rank = Arc::new(engine.dp_rank(1));
    assert_eq!(rank.id().as_str(), "http://10.0.0.5:8100@1");
    let guard = rank.track();
    assert_eq!((rank.in_flight(), engine.in_flight()), (1, 1));
    drop(guard);
    assert_eq!((rank.in_flight(), engine.in_flight()), (0, 0));
}

#[test]
fn weights_are_set_checked_and_carried_to_ranks() {
    let ep = Endpoint::new("http://10.0.0.5:8100", Role::Decode).unwrap();
    assert_eq!(ep.weight(), 1.0);
    let ep = Arc::new(ep.with_weight(3.5).unwrap());
    assert_eq!(ep.dp_rank(2).weight(), 3.5);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = Endpoint::new("http://h:1", Role::Decode).unwrap();
        assert!(
            matches!(e.with_weight(bad), Err(EndpointError::InvalidWeight { .. })),
            "{bad}"
        );
    }
}

#[test]
fn link_local_and_metadata_hosts_are_refused_unless_allowed() {
    let refused = [
        "http://169.254.169.254",
        "http://169.254.0.1:8000",
        "https://169.254.255.255:443@3",
        "http://[fe80::1]:8000",
        "http://[febf:ffff::1]:8000",
        "http://[fd00:ec2::254]",
        "http://[::ffff:169.254.169.254]:80",
        "http://[::ffff:a9fe:a9fe]",
        "http://[::169.254.169.254]",
        "http://[64:ff9b::169.254.169.254]",
    ];
    for url in refused {
        assert!(
            matches!(
                Endpoint::new(url, Role::Decode),
                Err(EndpointError::RefusedAddress { .. })
            ),
            "{url}"
        );
        let allowed = Endpoint::with_address_policy(
            url,
            Role::Decode,
            http::Extensions::new(),
            AddressPolicy::allow_link_local(),
        );
        assert!(allowed.is_ok(), "{url}: {allowed:?}");
    }
    let kept = [
        "http://127.0.0.1:1",
        "http://10.0.0.5:8100",
        "http://169.253.255.255",
        "http://169.255.0.1",
        "http://[::1]:8000",
        "http://[::]:8000",
        "http://[fec0::1]:8000",
        "http://[fd00:ec2::253]",
        "http://[::ffff:10.0.0.1]",
        "http://metadata.google.internal",
    ];
    for url in kept {
        assert!(Endpoint::new(url, Role::Decode).is_ok(), "{url}");
    }
    let err = Endpoint::new("http://169.254.169.254", Role::Decode)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("169.254.169.254") && err.contains("metadata"),
        "{err}"
    );
}

#[test]
fn guards_count_in_flight() {
    let ep = Arc::new(Endpoint::new("http://h:1", Role::Prefill).unwrap());
    let a = ep.track();
    let b = ep.track();
    assert_eq!(ep.in_flight(), 2);
    drop(a);
    assert_eq!(ep.in_flight(), 1);
    drop(b);
    assert_eq!(ep.in_flight(), 0);
}

#[test]
fn load_is_in_flight_until_the_engine_count_is_set() {
    let ep = Arc::new(Endpoint::new("http://h:1", Role::Decode).unwrap());
    let a = ep.track();
    assert_eq!(ep.load(), 1);
    // The engine counts 7 (this router's request among them): the load is 7, and what
    // this router sends or ends after the read moves it from there.
    ep.set_engine_load(Some(7));
    assert_eq!(ep.load(), 7);
    let b = ep.track();
    let c = ep.track();
    assert_eq!(ep.load(), 9);
    drop((a, b));
    assert_eq!(ep.load(), 7);
    ep.set_engine_load(Some(0));
    assert_eq!(ep.load(), 0);
    drop(c);
    assert_eq!(ep.load(), 0, "never below zero");
    ep.set_engine_load(None);
    let _d = ep.track();
    assert_eq!(ep.load(), 1);
    ep.set_engine_load(Some(u64::MAX));
    assert_eq!(ep.load(), (u32::MAX - 1) as usize);
}

#[test]
fn a_rank_suffix_names_a_data_parallel_rank() {
    let ep = Endpoint::new("http://10.0.0.1:8100/@7", Role::Prefill).unwrap();
    assert_eq!(ep.rank(), Some(7));
    assert_eq!(ep.id().as_str(), "http://10.0.0.1:8100@7");
    assert_eq!(ep.authority().as_str(), "10.0.0.1:8100");
    assert_eq!(
        ep.api_uri(Api::Chat).unwrap().to_string(),
        "http://10.0.0.1:8100/v1/chat/completions"
    );
    assert!(matches!(
        Endpoint::new("http://h:1@99999999999", Role::Decode),
        Err(EndpointError::InvalidRank { .. })
    ));
    // User information is no rank, and no engine URL either.
    assert!(Endpoint::new("http://user@h:1", Role::Decode).is_err());
    let route = crate::router::Route::new(
        Some(Arc::new(ep)),
        Arc::new(Endpoint::new("http://d:1@2", Role::Decode).unwrap()),
    );
    assert_eq!((route.prefill_rank, route.decode_rank), (Some(7), Some(2)));
}

fn ep(url: &str, role: Role, models: &[&str]) -> Arc<Endpoint> {
    let ep = Endpoint::new(url, role).unwrap();
    Arc::new(if models.is_empty() {
        ep
    } else {
        ep.with_models(models.iter().copied())
    })
}

fn ids(eps: &[Arc<Endpoint>]) -> Vec<&str> {
    eps.iter().map(|e| e.id().as_str()).collect()
}

#[test]
fn a_set_without_declared_models_serves_any() {
    let set = EndpointSet::new([
        ep("http://p:1", Role::Prefill, &[]),
        ep("http://d:1", Role::Decode, &[]),
    ]);
    // No endpoint declares models: the set does not route by model.
    assert!(set.models.is_none());
    assert!(set.served_models().is_empty());
    assert!(std::ptr::eq(set.for_model(Some("anything")).unwrap(), &set));
    assert!(std::ptr::eq(set.for_model(None).unwrap(), &set));
}

#[test]
fn models_limit_the_candidates() {
    let set = EndpointSet::new([
        ep("http://p1:1", Role::Prefill, &["llama"]),
        ep("http://p2:1", Role::Prefill, &["qwen", "llama"]),
        ep("http://d1:1", Role::Decode, &["llama"]),
        ep("http://d2:1", Role::Decode, &["qwen"]),
        ep("http://p3:1", Role::Prefill, &["mistral"]),
    ]);
    // Some endpoint declares models: the set routes by model.
    assert!(set.models.is_some());
    assert_eq!(
        set.served_models().iter().map(|m| &**m).collect::<Vec<_>>(),
        ["llama", "qwen"],
        "a model only a prefill serves cannot be served"
    );
    let llama = set.for_model(Some("llama")).unwrap();
    assert_eq!(ids(llama.prefill()), ["http://p1:1", "http://p2:1"]);
    assert_eq!(ids(llama.decode()), ["http://d1:1"]);
    let qwen = set.for_model(Some("qwen")).unwrap();
    assert_eq!(ids(qwen.prefill()), ["http://p2:1"]);
    assert_eq!(ids(qwen.decode()), ["http://d2:1"]);
    match set.for_model(Some("mistral")) {
        Err(RouteError::UnknownModel { model, served }) => {
            assert_eq!(model, "mistral");
            assert_eq!(served.len(), 2);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        set.for_model(Some("gpt")),
        Err(RouteError::UnknownModel { .. })
    ));
    assert!(matches!(
        set.for_model(None),
        Err(RouteError::ModelRequired { .. })
    ));
}

#[test]
fn undeclared_endpoints_serve_every_model_and_the_rest() {
    let set = EndpointSet::new([
        ep("http://p1:1", Role::Prefill, &[]),
        ep("http://d1:1", Role::Decode, &["llama"]),
        ep("http://d2:1", Role::Decode, &[]),
    ]);
    let llama = set.for_model(Some("llama")).unwrap();
    assert_eq!(ids(llama.prefill()), ["http://p1:1"]);
    assert_eq!(ids(llama.decode()), ["http://d1:1", "http://d2:1"]);
    let other = set.for_model(Some("other")).unwrap();
    assert_eq!(ids(other.decode()), ["http://d2:1"]);
    // One declared model: a request naming none goes to it.
    let one = EndpointSet::new([ep("http://d1:1", Role::Decode, &["llama"])]);
    assert_eq!(ids(one.for_model(None).unwrap().decode()), ["http://d1:1"]);
}

#[test]
fn a_rank_endpoint_has_its_engines_facts() {
    let facts = Facts::default()
        .with(Facts::BOOTSTRAP_PORT, "8998")
        .unwrap();
    let engine = Arc::new(
        Endpoint::new("http://10.0.0.5:8100", Role::Prefill)
            .unwrap()
            .with_facts(facts.clone()),
    );
    assert_eq!(engine.dp_rank(2).facts(), &facts);
    assert_eq!(
        Endpoint::new("http://10.0.0.5:8100", Role::Prefill)
            .unwrap()
            .facts(),
        &Facts::default()
    );
}

#[test]
fn encoders_are_kept_apart_and_filtered_by_model_like_the_others() {
    let set = EndpointSet::new([
        ep("http://e1:1", Role::Encode, &["llava"]),
        ep("http://p1:1", Role::Prefill, &[]),
        ep("http://d1:1", Role::Decode, &["llava"]),
        ep("http://d2:1", Role::Decode, &["qwen"]),
        ep("http://e2:1", Role::Encode, &[]),
        ep("http://e3:1", Role::Encode, &["pixtral"]),
    ]);
    // Never a prefill or a decode: routers read those two only.
    assert_eq!(ids(set.prefill()), ["http://p1:1"]);
    assert_eq!(ids(set.decode()), ["http://d1:1", "http://d2:1"]);
    assert_eq!(
        ids(set.by_role(Role::Encode)),
        ["http://e1:1", "http://e2:1", "http://e3:1"]
    );
    assert_eq!((set.len(), set.iter().count()), (6, 6));
    // A model only an encoder declares is served by no one.
    assert_eq!(
        set.served_models().iter().map(|m| &**m).collect::<Vec<_>>(),
        ["llava", "qwen"]
    );
    assert!(set.for_model(Some("pixtral")).is_err());
    // Per model: the encoders declaring it and those declaring none.
    let llava = set.for_model(Some("llava")).unwrap();
    assert_eq!(
        ids(llava.by_role(Role::Encode)),
        ["http://e1:1", "http://e2:1"]
    );
    let qwen = set.for_model(Some("qwen")).unwrap();
    assert_eq!(ids(qwen.by_role(Role::Encode)), ["http://e2:1"]);
    assert_eq!(Role::Encode.to_string(), "encode");
}

#[test]
fn a_static_source_adds_and_removes_encoders() {
    use crate::source::{EndpointSource, StaticSource};
    let source = StaticSource::new([
        Endpoint::new("http://p:1", Role::Prefill).unwrap(),
        Endpoint::new("http://d:1", Role::Decode).unwrap(),
    ]);
    source.insert(Endpoint::new("http://e:1", Role::Encode).unwrap());
    assert_eq!(ids(source.snapshot().by_role(Role::Encode)), ["http://e:1"]);
    assert!(source.remove("http://e:1"));
    assert!(source.snapshot().by_role(Role::Encode).is_empty());
    assert_eq!(source.snapshot().len(), 2);
}

/// A set of `n` endpoints of every role, each declaring `k` names of `pool` (some twice,
/// some none at all, some an empty list), chosen by a fixed sequence.
fn many(n: usize, k: usize, pool: usize) -> Vec<Arc<Endpoint>> {
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    (0..n)
        .map(|i| {
            let role = [Role::Prefill, Role::Decode, Role::Decode, Role::Encode][i % 4];
            let ep = Endpoint::new(&format!("http://e{i}:1"), role).unwrap();
            Arc::new(match i % 10 {
                // Declares no model: serves any.
                3 => ep,
                // Declares an empty list: serves none.
                7 => ep.with_models(Vec::<Arc<str>>::new()),
                _ => {
                    let mut names: Vec<String> =
                        (0..k).map(|_| format!("model-{}", next(pool))).collect();
                    names.push(names[0].clone());
                    ep.with_models(names)
                }
            })
        })
        .collect()
}

/// The endpoints of `set` serving `model`, by role, by a scan of each one's names.
fn reference<'a>(set: &'a EndpointSet, model: &str, role: Role) -> Vec<&'a str> {
    set.by_role(role)
        .iter()
        .filter(|e| e.serves(model))
        .map(|e| e.id().as_str())
        .collect()
}

#[test]
fn a_large_index_answers_as_a_scan_of_every_endpoint_does() {
    let (n, k, pool) = (400, 24, 300);
    let set = EndpointSet::new(many(n, k, pool));
    let mut served: Vec<&str> = set
        .decode()
        .iter()
        .filter_map(|e| e.models())
        .flatten()
        .map(|m| &**m)
        .collect();
    served.sort_unstable();
    served.dedup();
    assert_eq!(
        set.served_models().iter().map(|m| &**m).collect::<Vec<_>>(),
        served
    );
    let undeclared: Vec<_> = set.iter().filter(|e| e.models().is_none()).collect();
    for i in 0..pool + 5 {
        let model = format!("model-{i}");
        let declared = set.iter().any(|e| {
            e.models()
                .is_some_and(|ms| ms.iter().any(|m| **m == *model))
        });
        match set.for_model(Some(&model)) {
            Ok(found) => {
                for role in [Role::Prefill, Role::Decode, Role::Encode] {
                    let expected = if declared {
                        reference(&set, &model, role)
                    } else {
                        // A name nobody declares: the endpoints declaring none.
                        ids(set.by_role(role))
                            .into_iter()
                            .filter(|id| undeclared.iter().any(|e| e.id().as_str() == *id))
                            .collect()
                    };
                    assert_eq!(ids(found.by_role(role)), expected, "{model} {role}");
                }
            }
            Err(e) => assert!(reference(&set, &model, Role::Decode).is_empty(), "{e}"),
        }
    }
    // A name twice in one declaration: the endpoint once in its subset.
    let twice = EndpointSet::new([
        ep("http://d1:1", Role::Decode, &["a", "b", "a"]),
        ep("http://d2:1", Role::Decode, &[]),
    ]);
    assert_eq!(
        ids(twice.for_model(Some("a")).unwrap().decode()),
        ["http://d1:1", "http://d2:1"]
    );
    // No model named, several served: the endpoints declaring none.
    assert_eq!(
        ids(twice.for_model(None).unwrap().decode()),
        ["http://d2:1"]
    );
    // An empty declaration serves nothing, and is not "undeclared".
    let empty = EndpointSet::new([
        ep("http://d1:1", Role::Decode, &["a"]),
        Arc::new(
            Endpoint::new("http://d2:1", Role::Decode)
                .unwrap()
                .with_models(Vec::<Arc<str>>::new()),
        ),
    ]);
    assert_eq!(
        ids(empty.for_model(Some("a")).unwrap().decode()),
        ["http://d1:1"]
    );
    assert!(empty.for_model(Some("b")).is_err());
    assert_eq!(
        ids(empty.for_model(None).unwrap().decode()),
        ["http://d1:1"]
    );
}

/// The index costs the declarations it reads (a count of name lookups, no clock): a
/// scan of every endpoint's names per declared model cost models × endpoints × names.
#[test]
fn building_the_index_costs_the_declarations_not_their_product() {
    let (n, k, pool) = (400, 40, 400);
    let endpoints = many(n, k, pool);
    let declarations: u64 = endpoints
        .iter()
        .filter_map(|e| e.models())
        .map(|ms| ms.len() as u64)
        .sum();
    index_cost::take();
    let set = EndpointSet::new(endpoints);
    let steps = index_cost::take();
    assert!(set.served_models().len() > 300);
    // One lookup per declared name to number the names, one to place each endpoint.
    assert!(
        steps <= 2 * declarations,
        "{steps} name steps for {declarations} declared names"
    );
}

#[test]
fn a_retained_set_keeps_its_models_served() {
    let set = EndpointSet::new(
        [
            Endpoint::new("http://d1:1", Role::Decode)
                .unwrap()
                .with_models(["llama"]),
            Endpoint::new("http://d2:1", Role::Decode)
                .unwrap()
                .with_models(["qwen"]),
            Endpoint::new("http://any:1", Role::Decode).unwrap(),
        ]
        .map(Arc::new),
    );
    // Left with the endpoint declaring no model: it serves any name, and a request
    // naming none goes to it, as in the whole set.
    let any = set.retain(|e| e.models().is_none());
    assert_eq!(any.served_models(), set.served_models());
    for model in [Some("llama"), Some("gpt"), None] {
        let to = any.for_model(model).unwrap();
        assert_eq!(to.by_role(Role::Decode)[0].id().as_str(), "http://any:1");
    }
    // Left with nothing: each served model has no decode, an unknown one is unknown.
    let none = set.retain(|_| false);
    assert!(matches!(
        none.for_model(Some("qwen")),
        Err(RouteError::NoDecode)
    ));
    assert!(matches!(
        none.for_model(Some("gpt")),
        Err(RouteError::UnknownModel { .. })
    ));
    assert!(matches!(
        none.for_model(None),
        Err(RouteError::ModelRequired { .. })
    ));
    // A set declaring no model retains as a plain filter.
    let plain = EndpointSet::new([Arc::new(Endpoint::new("http://d:1", Role::Decode).unwrap())]);
    assert!(plain.retain(|_| true).served_models().is_empty());
}
