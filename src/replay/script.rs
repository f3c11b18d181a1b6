//! Scripted misbehaviour of a run: what a faulty (or hostile) gateway could answer to the run's
//! `agent` request (a malformed ACK, one naming another session or run), send around the final
//! `res`, or answer to `agent.wait`, that a recorded run never shows. Chaos tests use it to check
//! that clawmux keeps the `agent` final `res` as the one truth, ends a run the gateway answers
//! wrongly as `gateway_protocol_error` (and cancels its gateway run), and ends every run exactly once.
//!
//! A script is registered on the handle ([`ReplayHandle::script_runs`](super::ReplayHandle::script_runs))
//! for every run whose message contains a marker; the run replays its track as usual and the
//! script changes only its ACK (which it can lose or patch), its end and its `agent.wait` answers:
//!
//! ```text
//! ACK (+ ack_patch)
//! … recorded events due before the final …
//! before_final frames          (e.g. a chat `final` with other text, a chat `aborted`)
//! final `res` (+ final_patch)  (the authoritative answer)
//! after_final frames           (e.g. a chat `error`, a second final `res`)
//! … recorded events due after the final …
//! ```

use serde_json::{json, Value};

/// How a scripted run answers and ends. The default changes nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunScript {
    /// Merged into the ACK payload like [`Self::final_patch`] (a non-object replaces it): e.g.
    /// `{"runId": null}` (malformed), `{"sessionKey": "agent:main:other"}` (another session).
    /// Repeated requests of the same key (`in_flight`) get the patched ACK too.
    pub ack_patch: Option<Value>,
    /// Merged into the final `res` payload: objects key by key (recursively), anything else
    /// replaced; a `null` removes the key. E.g. `{"result":{"payloads":[{"text":"other"}]}}`.
    pub final_patch: Option<Value>,
    /// Sent right before the final `res`, in order.
    pub before_final: Vec<ScriptFrame>,
    /// Sent right after the final `res`, in order.
    pub after_final: Vec<ScriptFrame>,
    /// `true`: the `res` that acknowledges the run is never sent, as when it was lost with a
    /// client that died between sending `agent` and reading the answer. The run itself is taken
    /// (and deduped) and plays on as usual.
    pub lose_ack: bool,
    /// The answer to every `agent.wait` for the run, verbatim and at once, instead of the real
    /// wait: e.g. a malformed snapshot, or `{"status":"timeout"}` without waiting at all.
    pub wait_reply: Option<Value>,
}

/// One scripted frame of a run.
#[derive(Debug, Clone, PartialEq)]
pub enum ScriptFrame {
    /// A `chat` event of the run: `runId`, `sessionKey` and the next per-run `seq` are filled in;
    /// `text` is the cumulative message text (`errorMessage` too for state `error`).
    Chat {
        /// `delta`, `final`, `aborted`, `error` (or anything else: the gateway is misbehaving).
        state: String,
        /// Cumulative text.
        text: String,
    },
    /// Another `res` to the run's `agent` request (same request id, to the requesting connection)
    /// with this payload; `runId` is added when the payload is an object without one.
    Res(Value),
    /// Any event, broadcast with the run's delivery rules; `runId` and `sessionKey` are added when
    /// the payload is an object without them (`seq` is left as given).
    Event {
        /// Event name (`chat`, `agent`, `health`, ...).
        name: String,
        /// Its payload.
        payload: Value,
    },
}

impl ScriptFrame {
    /// A chat event in `state` with cumulative `text`.
    pub fn chat(state: &str, text: impl Into<String>) -> Self {
        Self::Chat { state: state.to_owned(), text: text.into() }
    }
}

/// Merges `patch` into `target` (objects recursively; `null` removes; anything else replaces).
pub(crate) fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else if let Some(existing) = t.get_mut(k) {
                    merge(existing, v);
                } else {
                    t.insert(k.clone(), v.clone());
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// Adds `key: value` to an object payload that lacks the key (other payloads stay as they are).
pub(crate) fn fill(payload: &mut Value, key: &str, value: &str) {
    if let Some(obj) = payload.as_object_mut() {
        obj.entry(key.to_owned()).or_insert_with(|| json!(value));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn merge_patches_objects_and_replaces_the_rest() {
        let mut v = json!({"status": "ok", "result": {"payloads": [{"text": "a"}], "meta": {"x": 1, "y": 2}}});
        merge(&mut v, &json!({"result": {"payloads": [{"text": "b"}], "meta": {"y": null, "z": 3}}}));
        assert_eq!(v, json!({"status": "ok", "result": {"payloads": [{"text": "b"}], "meta": {"x": 1, "z": 3}}}));
    }

    #[test]
    fn fill_adds_only_missing_keys() {
        let mut v = json!({"runId": "mine"});
        fill(&mut v, "runId", "other");
        fill(&mut v, "sessionKey", "sk");
        assert_eq!(v, json!({"runId": "mine", "sessionKey": "sk"}));
        let mut s = json!("text");
        fill(&mut s, "runId", "r");
        assert_eq!(s, json!("text"));
    }
}
