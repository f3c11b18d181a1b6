//! The common frame decoded in one pass: a `chat` or `agent` event whose `type` and `event` come
//! before its `payload`, as the gateway writes them. The general decoding reads the payload twice
//! (once to find where it ends, once into its type); this reads it once, straight into its type.
//!
//! It only ever answers for frames the general decoding accepts, with the same result: anything
//! else (another kind or event, a different key order, a frame it cannot decode) is left to the
//! general decoding, which then also gives the same error as before for a frame that is refused.

use crate::error::ErrorShape;
use crate::events::GatewayEvent;
use crate::wire::Str;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::fmt;

/// A `chat` or `agent` event and the frame's `seq`, or `None`: decode it the general way.
pub(crate) fn routed_event(text: &str) -> Option<(GatewayEvent, Option<u64>)> {
    if !text.trim_start().starts_with('{') {
        return None;
    }
    serde_json::from_str::<OnePass>(text).ok()?.0
}

/// The decoded event and the frame's `seq`; `None` when the frame is not one this path takes.
struct OnePass(Option<(GatewayEvent, Option<u64>)>);

/// The frame's `seq`, read as leniently as the general decoding reads it.
#[derive(Deserialize)]
struct Lenient(#[serde(deserialize_with = "crate::num::lenient_u64")] Option<u64>);

/// The events this path decodes (the ones routed to runs, nearly every frame of a busy gateway).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Routed {
    /// A `chat` event.
    Chat,
    /// An `agent` event.
    Agent,
}

/// The frame's fields, each at most once (a repeated one makes the general decoding refuse the
/// frame, so it is left to it).
const FIELDS: [&str; 10] = ["type", "id", "method", "ok", "params", "payload", "error", "event", "seq", "traceparent"];

impl<'de> Deserialize<'de> for OnePass {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = OnePass;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a frame")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OnePass, A::Error> {
                let not_here = || de::Error::custom("left to the general decoding");
                let mut seen = [false; FIELDS.len()];
                let (mut is_event, mut name, mut event, mut seq) = (false, None, None, None);
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    let Some(i) = FIELDS.iter().position(|f| *f == key.as_str()) else {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    };
                    if std::mem::replace(&mut seen[i], true) {
                        return Err(not_here());
                    }
                    match FIELDS[i] {
                        "type" => {
                            if map.next_value::<Str<'de>>()?.as_str() != "event" {
                                return Err(not_here());
                            }
                            is_event = true;
                        }
                        "event" => {
                            name = match map.next_value::<Option<Str<'de>>>()?.as_ref().map(Str::as_str) {
                                Some("chat") => Some(Routed::Chat),
                                Some("agent") => Some(Routed::Agent),
                                _ => return Err(not_here()),
                            };
                        }
                        "payload" => {
                            event = Some(match (is_event, name) {
                                (true, Some(Routed::Chat)) => GatewayEvent::Chat(map.next_value::<crate::events::ChatPayload>()?.0),
                                (true, Some(Routed::Agent)) => GatewayEvent::Agent(map.next_value::<crate::events::AgentPayload>()?.0),
                                _ => return Err(not_here()),
                            });
                        }
                        "seq" => seq = map.next_value::<Lenient>()?.0,
                        "id" | "method" | "traceparent" => drop(map.next_value::<Option<Str<'de>>>()?),
                        "ok" => drop(map.next_value::<Option<bool>>()?),
                        "params" => drop(map.next_value::<Option<&'de RawValue>>()?),
                        _ => drop(map.next_value::<Option<ErrorShape>>()?),
                    }
                }
                Ok(OnePass(event.map(|e| (e, seq))))
            }
        }
        d.deserialize_map(V)
    }
}
