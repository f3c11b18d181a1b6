//! Wire types of the OpenClaw gateway protocol, as a multiplexer uses them.
//!
//! # Layout
//! - [`frame`]: the three frame kinds (`req`, `res`, `event`), strict and size-bounded decoding
//!   ([`decode_frame`]) and encoding of outbound frames.
//! - [`handshake`]: `connect.challenge`, `connect` params, `hello-ok` (protocol 3 and 4).
//! - [`methods`]: params and results of the methods a multiplexer calls (`sessions.patch`,
//!   `sessions.messages.subscribe`, `agent`, `agent.wait`, `chat.abort`, `sessions.abort`).
//! - [`events`]: the events a multiplexer routes (`chat`, `agent`) or acts on (`tick`, `shutdown`).
//! - [`error`]: the gateway's error shape and the codes seen in the field.
//! - `one_pass`: the common frame (a `chat`/`agent` event) decoded in one pass.
//! - [`num`]: numbers clawmux only reads as hints, decoded leniently (a bad one is absent).
//! - [`session_key`]: canonical session keys (the gateway lower-cases them).
//! - [`trace`]: W3C `traceparent` values (protocol 4 forwards them to the LLM).
//! - [`wire`]: borrowed pieces of the decoding (strings not copied, a message reduced to its text).
//!
//! No I/O lives here. Decoding is strict where a multiplexer depends on a field (a malformed known
//! frame is an error) and tolerant of fields the gateway adds over releases (hello-ok alone has
//! dozens); an unknown event name is not an error, it decodes to [`GatewayEvent::Other`].

pub mod error;
pub mod events;
pub mod frame;
pub mod handshake;
pub mod methods;
pub mod num;
mod one_pass;
pub mod session_key;
pub mod trace;
pub mod wire;
#[cfg(test)]
mod reference;

pub use error::{DecodeError, ErrorCode, ErrorShape};
pub use events::{AgentEvent, ChatEvent, ChatState, GatewayEvent, Shutdown, Tick};
pub use frame::{decode_frame, encode_request, EventFrame, Frame, RequestFrame, ResponseFrame};
pub use handshake::{ConnectChallenge, ConnectParams, HelloOk, Policy};
pub use session_key::SessionKey;
pub use trace::TraceParent;
