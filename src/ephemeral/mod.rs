//! Ephemeral runs: each run in its own one-shot, network-less, hardened container running
//! `openclaw agent --local`, its LLM calls leaving only through a per-run unix socket served by
//! clawmux's attribution proxy (README: "Execution modes").
//!
//! - [`openclaw_config`]: the generated `openclaw.json` (invariants 13–17), pure.
//! - [`container`]: the container's create body, command and labels, pure.
//! - [`envelope`]: the JSON envelope the CLI prints, pure (untrusted input, property-tested).
//! - [`outcome`]: a container's end → the run's events, pure.
//! - [`socket`]: the run's LLM socket (the proxy, scoped to the run).
//! - [`runner`]: the [`runner::Runner`] trait and its Docker implementation.
//! - [`flow`]: one run's execution (FIFO slot, workspace, socket, container, cancel, timeout,
//!   clean-up).
//! - [`actor`]: the run's actor, registered in the one registry of live runs like a session actor.
//! - [`doctor`]: `clawmux doctor`'s checks.

pub mod actor;
pub mod container;
pub mod doctor;
pub mod envelope;
pub mod flow;
pub mod openclaw_config;
pub mod outcome;
pub mod runner;
pub mod socket;

pub use actor::ContainerRun;
pub use flow::{Ephemeral, EphemeralConfig, Job};
