//! Replays: asking an engine's `ROUTER` replay socket for the batches a rank missed
//! (a gap, or the history a first subscription catches up on), reading its answers in
//! every form the engines send, and backing off after failures.

use bytes::Bytes;

use super::*;

/// Why a replay did not cover a gap.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReplayError {
    #[error("zmq: {0}")]
    Zmq(#[from] disagg_zmtp::Error),
    #[error("timed out")]
    Timeout,
    #[error("the engine's buffer starts at {first:?}, after {wanted}")]
    Incomplete { wanted: u64, first: Option<u64> },
    #[error("malformed replay message")]
    Malformed,
    #[error("the replay brought more than {0} bytes")]
    Budget(usize),
}

/// One message of a replay answer, as the `DEALER` receives it.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ReplayMessage<'a> {
    /// A buffered batch.
    Batch { seq: u64, payload: &'a [u8] },
    /// The end marker.
    End,
}

/// Reads one message of a replay answer (the `ROUTER` strips the identity it leads
/// with): `[empty, seq, payload]` (vLLM's and SGLang's), `[empty, topic, seq,
/// payload]`, the end as either with seq -1, or `[empty, empty]` (older vLLM's end).
pub(super) fn replay_message(frames: &[Bytes]) -> Result<ReplayMessage<'_>, ReplayError> {
    let (seq, payload) = match frames {
        [delimiter, end] if delimiter.is_empty() && end.is_empty() => {
            return Ok(ReplayMessage::End);
        }
        [delimiter, seq, payload] | [delimiter, _, seq, payload] if delimiter.is_empty() => {
            (seq, payload)
        }
        _ => return Err(ReplayError::Malformed),
    };
    let seq = <[u8; 8]>::try_from(&seq[..])
        .map(u64::from_be_bytes)
        .map_err(|_| ReplayError::Malformed)?;
    Ok(if seq == END_SEQ {
        ReplayMessage::End
    } else {
        ReplayMessage::Batch { seq, payload }
    })
}

impl RankTask {
    /// Whether a replay may be tried now (not backing off after failures).
    pub(super) fn replay_allowed(&self) -> bool {
        self.replay_after
            .is_none_or(|after| tokio::time::Instant::now() >= after)
    }

    /// Records a replay's outcome: a failure backs the next one off.
    pub(super) fn replay_done(&mut self, ok: bool) {
        if ok {
            self.replay_failures = 0;
            self.replay_after = None;
        } else {
            self.replay_failures = self.replay_failures.saturating_add(1);
            let pause = self.shared.config.backoff(self.replay_failures);
            self.replay_after = Some(tokio::time::Instant::now() + pause);
        }
    }

    /// Replays the engine's history before `until`, as much as its buffer holds. A
    /// replay that fails drops the rank's entries, the ones it applied included: the
    /// batches after them (which may have removed them) are unknown.
    pub(super) async fn catch_up(&mut self, until: u64) {
        let replayed_before = self.replayed();
        let replayed = self.replay_range(0, until, false).await;
        self.replay_done(replayed.is_ok());
        if let Err(e) = replayed {
            // Entries to drop only if the replay applied some (the caller may have just
            // dropped the rank's, and a drop is counted once).
            let partial = self.replayed() > replayed_before;
            tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, until, error = %e, partial, "kv events: catch-up replay failed, dropping what it applied");
            self.shared
                .index
                .clear(&self.shared.engine, self.shared.rank);
            self.status(|s| {
                s.replay_failures += 1;
                if partial {
                    s.drops += 1;
                }
            });
        }
    }

    /// The batches replayed into this rank so far.
    pub(super) fn replayed(&self) -> u64 {
        lock(&self.shared.statuses)
            .get(&(self.shared.engine.clone(), self.shared.rank))
            .map_or(0, |s| s.replayed)
    }

    /// Fills the gap `[from, until)` by replay, or drops the rank's entries.
    pub(super) async fn recover(&mut self, from: u64, until: u64) {
        if self.replay.is_some() {
            if self.replay_allowed() {
                let replayed = self.replay_range(from, until, true).await;
                self.replay_done(replayed.is_ok());
                match replayed {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, from, until, error = %e, "kv events: replay failed");
                        self.status(|s| s.replay_failures += 1);
                    }
                }
            } else {
                self.status(|s| s.replays_skipped += 1);
            }
        }
        tracing::info!(engine = %self.shared.engine, rank = self.shared.rank, from, until, "kv events: batches lost, dropping the rank's entries");
        self.shared
            .index
            .clear(&self.shared.engine, self.shared.rank);
        self.status(|s| s.drops += 1);
    }

    /// Asks the replay socket for `[from, until)` and applies what it returns, in
    /// order, as it comes: one message at a time in memory, the connection closed as
    /// soon as `until - 1` arrived, at most [`SubscriberConfig::replay_max_bytes`]
    /// read. With `exact`, fails unless every batch came back in order. What it
    /// applied before failing is dropped by the caller with the rest of the rank's
    /// entries.
    pub(super) async fn replay_range(
        &mut self,
        from: u64,
        until: u64,
        exact: bool,
    ) -> Result<(), ReplayError> {
        let Some(endpoint) = self.replay.clone() else {
            return Ok(());
        };
        let timeout = self.shared.config.replay_timeout;
        let result =
            tokio::time::timeout(timeout, self.stream_replay(&endpoint, from, until, exact))
                .await
                .unwrap_or(Err(ReplayError::Timeout));
        if let Err(e) = &result {
            let why = match e {
                ReplayError::Zmq(z) => Malformed::of_zmtp(z),
                ReplayError::Malformed => Some(Malformed::Shape),
                _ => None,
            };
            if let Some(why) = why {
                self.shared.malformed(SocketKind::Replay, why);
            }
        }
        result
    }

    pub(super) async fn stream_replay(
        &mut self,
        endpoint: &str,
        from: u64,
        until: u64,
        exact: bool,
    ) -> Result<(), ReplayError> {
        let config = Arc::clone(&self.shared.config);
        let mut dealer = Dealer::connect(
            endpoint,
            config.limits(config.max_message),
            config.connect_timeout,
        )
        .await?;
        // A DEALER talking to a ROUTER: an empty delimiter, then the request.
        dealer.send(&[b"", &from.to_be_bytes()]).await?;
        let mut expected = from;
        let mut bytes = 0usize;
        while expected < until {
            let frames = dealer.recv().await?;
            let (seq, payload) = match replay_message(&frames)? {
                ReplayMessage::Batch { seq, payload } => (seq, payload),
                ReplayMessage::End => break,
            };
            bytes = bytes.saturating_add(frames.iter().map(Bytes::len).sum());
            if bytes > config.replay_max_bytes {
                return Err(ReplayError::Budget(config.replay_max_bytes));
            }
            if !(from..until).contains(&seq) || seq < expected {
                continue;
            }
            if exact && seq != expected {
                return Err(ReplayError::Incomplete {
                    wanted: expected,
                    first: Some(seq),
                });
            }
            // Counted before it is applied, so that whoever sees this batch in
            // `batches` also sees it in `replayed`.
            self.status(|s| s.replayed += 1);
            self.apply(seq, payload, SocketKind::Replay);
            expected = seq + 1;
        }
        if exact && expected < until {
            return Err(ReplayError::Incomplete {
                wanted: expected,
                first: None,
            });
        }
        Ok(())
    }
}
