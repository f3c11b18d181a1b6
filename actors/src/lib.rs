//! The stateful, concurrent half of clawmux.
//!
//! # Layout
//! - [`supervisor`]: the actor that owns the ONE gateway connection, routes frames fail-closed,
//!   admits runs (one at a time per session key) and reconnects.
//! - [`session`]: one actor per run: patch → subscribe → agent → stream → final, cancellation,
//!   recovery after a reconnect.
//! - [`connection`]: the WebSocket task (connect, handshake, frame pump) beside the supervisor.
//! - [`run`]: the run's spec, events and outcome: the types shared with the HTTP layer.
//! - Pure logic, unit- and property-tested: [`backoff`] (reconnect delays), [`delta`] (cumulative
//!   text → increments by prefix), [`routes`] (the fail-closed routing table), [`queue`] (per-key
//!   FIFO admission), [`limits`] (bounds on every number the gateway sends).
//! - [`metrics`]: Prometheus counters and gauges of all of the above.

pub mod backoff;
pub mod connection;
pub mod delta;
pub mod device;
pub mod limits;
pub mod metrics;
pub mod queue;
pub mod routes;
pub mod run;
pub mod session;
pub mod supervisor;

pub use run::{CancelReason, ErrorCode, Phase, RunEvent, RunOutcome, RunSink, RunSpec, RunStatus};
pub use supervisor::{GatewayStatus, OutboundHeadersMode, StatusHandle, Supervisor, SupervisorConfig};
