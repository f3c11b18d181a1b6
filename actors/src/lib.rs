//! The stateful, concurrent half of clawmux: every run's whole life.
//!
//! # Layout
//! - [`registry`]: the one registry of live runs: admission, the session-key and branch-key locks
//!   (FIFO), cancels, shutdown (hand off or cancel).
//! - [`session`]: one actor per run, from admission to its terminal event: queue and lock waits,
//!   workspace, patch → subscribe → agent → stream → final, publishing, its timeout, cancellation,
//!   recovery after a reconnect or a restart of clawmux.
//! - [`supervisor`]: the actor that owns the ONE gateway connection: request ids, fail-closed
//!   routing of frames, reconnects, liveness, and cancelling runs abandoned during an outage.
//! - [`connection`]: the WebSocket task (connect, handshake, frame pump) beside the supervisor.
//! - [`messages`]: every message between those actors, and the ports (recipients) they use, so
//!   each actor can be tested with probes.
//! - [`run`]: the run's spec, events, checkpoints and outcome: the types shared with the HTTP layer
//!   and the run store; [`branch`]: branch runs and the [`branch::Workspace`] trait the git relay
//!   implements.
//! - Pure logic, unit- and property-tested: [`backoff`] (reconnect delays), [`delta`] (cumulative
//!   text → increments by prefix, also across a restart), [`routes`] (the fail-closed routing
//!   table), [`queue`] (per-key FIFO locks), [`limits`] (bounds on every number the gateway sends),
//!   [`start_clock`] (the stages of a new run's wait for `accepted`, for a histogram).
//! - [`metrics`]: Prometheus counters and gauges of all of the above; [`device`]: the Ed25519
//!   device identity.
//! - `testkit` (tests only): a probe in place of the supervisor and the registry, a recording run
//!   sink, a workspace whose steps the test ends; `session/tests.rs` and `registry/tests.rs` use it.
//!
//! Module dependencies point one way: `registry` → `session`/`supervisor` →
//! `messages`/`run`/`branch` and the pure modules; `registry` uses only the supervisor's
//! `StatusHandle`, `supervisor` only the session's config types; nothing points back.

pub mod backoff;
pub mod branch;
pub mod connection;
pub mod delta;
pub mod device;
pub mod instance;
pub mod limits;
pub mod messages;
pub mod metrics;
pub mod queue;
pub mod registry;
pub mod routes;
pub mod run;
pub mod session;
pub mod start_clock;
pub mod supervisor;
#[cfg(test)]
mod testkit;

pub use messages::{AdmitError, Admitted, IfBusy, ShutdownMode};
pub use registry::{Registry, RegistryConfig};
pub use run::{CancelReason, Checkpoint, ErrorCode, Phase, Resume, ResumeStage, RunEvent, RunOutcome, RunSink, RunSpec, RunStatus};
pub use session::{OutboundHeadersMode, SessionConfig};
pub use supervisor::{GatewayStatus, StatusHandle, Supervisor, SupervisorConfig};
