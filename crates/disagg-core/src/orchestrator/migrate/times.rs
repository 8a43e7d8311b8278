//! What is known of a decode leg's time ([`LegTimes`]): the report that tells its
//! decode failed, when its stream broke and moved on, times the leg with it, and after
//! a migration the attempt's report times the decode that finished the answer with its
//! leg's.

use std::sync::Arc;
use std::time::Instant;

use crate::outcome::Timeline;

use super::super::respond::LateMarks;

/// When a decode leg of a migrating stream was sent (and the handoff step before it
/// began, when it had one), its head came and its first byte went to the client: what
/// the report that tells its decode failed (its stream broke and moved on, or a
/// continuation on it could not start) times the leg with, so that a trace draws the leg that broke (an
/// error span from its send to the break) and the metrics see its phases; and, for the
/// leg that finished the answer, what the attempt's report times its decode with.
/// Instants the leg's steps took anyway, kept on the leg (its first byte read off the
/// clock once per leg).
#[derive(Debug, Clone, Default)]
pub(super) struct LegTimes {
    /// The handoff step before the leg began (the first leg's, after the attempt's
    /// prefill; a continuation's through a fresh prefill).
    pub(super) handoff: Option<Instant>,
    /// The leg was sent.
    pub(super) sent: Option<Instant>,
    /// Its response head came.
    pub(super) head: Option<Instant>,
    /// Its first byte went to the client.
    pub(super) first: Option<Instant>,
    /// The attempt's marks of steps inside its body (the first leg's, sent after a
    /// lead of the proxy's own): its send and head, when they happened there.
    pub(super) late: Option<Arc<LateMarks>>,
}

impl LegTimes {
    /// The first leg's: the attempt's decode leg, as its steps in `tl` (and in its
    /// `late` marks) have it.
    pub(super) fn first_leg(tl: &Timeline, late: Option<&Arc<LateMarks>>) -> Self {
        LegTimes {
            handoff: tl.handoff_start,
            sent: tl.decode_sent,
            head: tl.decode_head,
            first: None,
            late: late.cloned(),
        }
    }

    /// A continuation's leg, sent at `sent`, its head at `head`.
    pub(super) fn sent(sent: Option<Instant>, head: Option<Instant>) -> Self {
        LegTimes {
            handoff: None,
            sent,
            head,
            first: None,
            late: None,
        }
    }

    /// The leg's steps as a decode leg's timeline that ended at `end` (the break, or
    /// its failure): its phases, and the span a trace draws, run from its send (its
    /// handoff step's from the handoff's start to the send).
    pub(super) fn timeline(&self, end: Instant) -> Timeline {
        let mut tl = Timeline {
            end: Some(end),
            ..Timeline::starting_at(end)
        };
        self.onto(&mut tl);
        tl.start = tl.handoff_start.or(tl.decode_sent).unwrap_or(end);
        tl
    }

    /// The leg's steps in `tl` in place of its decode leg's (and the handoff step's
    /// before it: none when the leg had none).
    pub(super) fn onto(&self, tl: &mut Timeline) {
        let late = |at: &std::sync::OnceLock<Instant>| at.get().copied();
        let (sent, head) = match &self.late {
            Some(l) => (
                late(&l.decode_sent).or(self.sent),
                late(&l.decode_head).or(self.head),
            ),
            None => (self.sent, self.head),
        };
        // A first byte before the leg was sent is the proxy's own lead's.
        let first = self.first.filter(|f| sent.is_none_or(|s| *f >= s));
        tl.handoff_start = self.handoff;
        tl.decode_sent = sent;
        tl.decode_head = head;
        tl.decode_first_chunk = first;
    }
}
