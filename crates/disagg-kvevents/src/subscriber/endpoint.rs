//! [`EngineEndpoint`]: where one engine publishes its KV events (and answers replays,
//! and publishes load reports), each data-parallel rank on the ports plus its rank;
//! parsed from the `ENGINE=tcp://HOST:PORT[,...]` form, with its [`EndpointError`]s.

/// Why an endpoint specification was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not `ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]`.
    #[error(
        "kv-events endpoint {0:?} is not ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]"
    )]
    Spec(String),
    /// Not `tcp://HOST:PORT` with a host a resolver takes (a DNS name, an IPv4 address,
    /// a bracketed IPv6 address; not a bind wildcard such as `*`) and a port from 1 to
    /// 65535.
    #[error("{0:?} is not tcp://HOST:PORT")]
    Tcp(String),
    /// An engine URL without a host.
    #[error("engine URL {0:?} has no host")]
    EngineUrl(String),
    /// Rank ports beyond 65535.
    #[error("port {port} plus {dp_size} ranks goes beyond 65535")]
    PortRange {
        /// Rank 0's port.
        port: u16,
        /// The ranks.
        dp_size: u32,
    },
}

/// Where one engine publishes its KV events.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EngineEndpoint {
    /// The engine's id, as the router names it (its base URL): the index's entries are
    /// kept under it.
    pub engine: String,
    /// Where rank 0 publishes: `tcp://HOST:PORT`.
    pub publisher: String,
    /// Where rank 0 answers replays, if it does: `tcp://HOST:PORT`.
    pub replay: Option<String>,
    /// Where rank 0 publishes its load reports, if it does (SGLang's
    /// `--load-publish-endpoint`): `tcp://HOST:PORT`.
    pub load: Option<String>,
    /// Data-parallel ranks (at least 1): rank `r` on the ports plus `r`.
    pub dp_size: u32,
}

impl EngineEndpoint {
    /// An engine with one rank and no replay endpoint.
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `publisher` is `tcp://HOST:PORT`.
    pub fn new(
        engine: impl Into<String>,
        publisher: impl Into<String>,
    ) -> Result<Self, EndpointError> {
        let publisher = publisher.into();
        tcp_port(&publisher)?;
        Ok(EngineEndpoint {
            engine: engine.into(),
            publisher,
            replay: None,
            load: None,
            dp_size: 1,
        })
    }

    /// With a replay endpoint.
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `replay` is `tcp://HOST:PORT`.
    pub fn with_replay(mut self, replay: impl Into<String>) -> Result<Self, EndpointError> {
        let replay = replay.into();
        tcp_port(&replay)?;
        self.replay = Some(replay);
        Ok(self)
    }

    /// With a load-report endpoint (see [`crate::load`]).
    ///
    /// # Errors
    ///
    /// [`EndpointError::Tcp`] unless `load` is `tcp://HOST:PORT`.
    pub fn with_load(mut self, load: impl Into<String>) -> Result<Self, EndpointError> {
        let load = load.into();
        tcp_port(&load)?;
        self.load = Some(load);
        Ok(self)
    }

    /// With `dp_size` data-parallel ranks (at least 1).
    ///
    /// # Errors
    ///
    /// [`EndpointError::PortRange`] when the last rank's port would pass 65535.
    pub fn with_dp_size(mut self, dp_size: u32) -> Result<Self, EndpointError> {
        let dp_size = dp_size.max(1);
        for endpoint in std::iter::once(&self.publisher)
            .chain(&self.replay)
            .chain(&self.load)
        {
            let port = tcp_port(endpoint)?;
            if u64::from(port) + u64::from(dp_size) - 1 > u64::from(u16::MAX) {
                return Err(EndpointError::PortRange { port, dp_size });
            }
        }
        self.dp_size = dp_size;
        Ok(self)
    }

    /// Reads `ENGINE=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,load=tcp://HOST:PORT][,dp-size=N]`
    /// (the proxy's `--kv-events-endpoint`, or a discovery annotation).
    ///
    /// # Errors
    ///
    /// An [`EndpointError`] for anything else.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_kvevents::EngineEndpoint;
    ///
    /// let e = EngineEndpoint::parse(
    ///     "http://10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,dp-size=2",
    /// )?;
    /// assert_eq!(e.engine, "http://10.0.0.5:8000");
    /// assert_eq!(e.publisher_of(1), "tcp://10.0.0.5:5558");
    /// assert_eq!(e.replay_of(1).as_deref(), Some("tcp://10.0.0.5:5559"));
    /// # Ok::<(), disagg_kvevents::subscriber::EndpointError>(())
    /// ```
    pub fn parse(spec: &str) -> Result<Self, EndpointError> {
        let bad = || EndpointError::Spec(spec.to_owned());
        let at = spec.find("=tcp://").ok_or_else(bad)?;
        let engine = &spec[..at];
        if engine.is_empty() {
            return Err(bad());
        }
        let mut parts = spec[at + 1..].split(',');
        let mut endpoint = EngineEndpoint::new(engine, parts.next().ok_or_else(bad)?)?;
        let mut dp_size = 1;
        for part in parts {
            match part.split_once('=') {
                Some(("replay", replay)) => endpoint = endpoint.with_replay(replay)?,
                Some(("load", load)) => endpoint = endpoint.with_load(load)?,
                Some(("dp-size", n)) => dp_size = n.parse().map_err(|_| bad())?,
                _ => return Err(bad()),
            }
        }
        endpoint.with_dp_size(dp_size)
    }

    /// The engine's own host, on `port` (and `replay_port`): the proxy's
    /// `--kv-events-port`, for engines that all publish on the same port.
    ///
    /// # Errors
    ///
    /// [`EndpointError::EngineUrl`] when `engine_url` has no host.
    ///
    /// # Examples
    ///
    /// ```
    /// use disagg_kvevents::EngineEndpoint;
    ///
    /// let e = EngineEndpoint::on_engine_host("http://[fd00::7]:8000/", 5557, Some(5558))?;
    /// assert_eq!(e.publisher, "tcp://[fd00::7]:5557");
    /// assert_eq!(e.replay.as_deref(), Some("tcp://[fd00::7]:5558"));
    /// # Ok::<(), disagg_kvevents::subscriber::EndpointError>(())
    /// ```
    pub fn on_engine_host(
        engine_url: &str,
        port: u16,
        replay_port: Option<u16>,
    ) -> Result<Self, EndpointError> {
        let host =
            url_host(engine_url).ok_or_else(|| EndpointError::EngineUrl(engine_url.to_owned()))?;
        let endpoint = EngineEndpoint::new(engine_url, format!("tcp://{host}:{port}"))?;
        match replay_port {
            Some(p) => endpoint.with_replay(format!("tcp://{host}:{p}")),
            None => Ok(endpoint),
        }
    }

    /// Where rank `rank` publishes.
    pub fn publisher_of(&self, rank: u32) -> String {
        offset_port(&self.publisher, rank)
    }

    /// Where rank `rank` answers replays.
    pub fn replay_of(&self, rank: u32) -> Option<String> {
        self.replay.as_deref().map(|r| offset_port(r, rank))
    }

    /// Where rank `rank` publishes its load reports.
    pub fn load_of(&self, rank: u32) -> Option<String> {
        self.load.as_deref().map(|l| offset_port(l, rank))
    }
}

/// The port of `tcp://HOST:PORT`, checked as the socket that connects to it reads it
/// ([`disagg_zmtp::conn::tcp_address`]: a host a resolver takes, a port from 1 to
/// 65535).
fn tcp_port(endpoint: &str) -> Result<u16, EndpointError> {
    let bad = || EndpointError::Tcp(endpoint.to_owned());
    let address = disagg_zmtp::conn::tcp_address(endpoint).map_err(|_| bad())?;
    let (_, port) = address.rsplit_once(':').ok_or_else(bad)?;
    port.parse().map_err(|_| bad())
}

/// `tcp://HOST:PORT` with the port plus `rank` (checked by [`EngineEndpoint::with_dp_size`]).
fn offset_port(endpoint: &str, rank: u32) -> String {
    match (endpoint.rsplit_once(':'), tcp_port(endpoint)) {
        (Some((base, _)), Ok(port)) => format!("{base}:{}", u32::from(port) + rank),
        _ => endpoint.to_owned(),
    }
}

/// The host of `scheme://host[:port][/...]`, brackets kept for IPv6.
fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        &authority[..=authority.find(']')?]
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then_some(host)
}
