//! A stream relayed as it is, watched for its API's sign of an answer ([`AnswerSign`]),
//! where a decode whose KV load failed ends its stream without an error event.

use disagg_json::{FinishReasons, ResponsesOutput};

use crate::request::Api;

/// What tells, as a stream goes by, that it carried its answer.
#[derive(Debug)]
pub(crate) enum AnswerSign {
    /// `/v1/completions`: a choice's finish reason. vLLM 0.33's completions stream whose
    /// KV load failed ends whole (`[DONE]`) with none.
    Finish(FinishReasons),
    /// `/v1/responses`: its first output item. vLLM 0.33's Responses stream whose KV
    /// load failed is cut off after its two opening events.
    Output(ResponsesOutput),
}

impl AnswerSign {
    /// The watch for `api`'s stream; `None` for an API whose failed KV load ends in an
    /// error event (the relay's error watch reads it) or an error status.
    pub(crate) fn of(api: Api) -> Option<Self> {
        match api {
            Api::Completions => Some(AnswerSign::Finish(FinishReasons::new())),
            Api::Responses => Some(AnswerSign::Output(ResponsesOutput::new())),
            _ => None,
        }
    }

    /// The stream's next bytes.
    pub(crate) fn watch(&mut self, data: &[u8]) {
        match self {
            AnswerSign::Finish(w) => w.watch(data),
            AnswerSign::Output(w) => w.watch(data),
        }
    }

    /// The stream, ended as its engine ended it, did not answer: a completions stream
    /// no choice of which finished.
    pub(crate) fn unfinished(&self) -> bool {
        matches!(self, AnswerSign::Finish(w) if !w.finished())
    }

    /// The stream, broken off, had not begun its answer: a Responses stream cut before
    /// its first output item.
    pub(crate) fn cut_unanswered(&self) -> bool {
        matches!(self, AnswerSign::Output(w) if !w.began())
    }
}
