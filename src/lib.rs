//! clawmux: an actor-based session multiplexer for the OpenClaw agent gateway.
//!
//! # Layout
//! - `protocol/` (crate `clawmux_protocol`): the gateway's wire types. No I/O.
//! - `actors/` (crate `clawmux_actors`): the supervisor (the ONE gateway connection, fail-closed
//!   routing, reconnects) and the per-run session actors.
//! - This crate, the binary's half:
//!   - [`config`]: the configuration table (TOML file + environment).
//!   - [`request`]: `POST /v1/runs` bodies: decoding and validation (pure); [`refname`]: branch
//!     keys and base refs, git's own ref-name rules plus clawmux's stricter ones (pure).
//!   - [`store`]: the durable run store (SQLite by default): run documents, events, idempotency,
//!     history, retention, and what a restart continues.
//!   - [`admission`]: how a run gets into the registry (new or continued after a restart): stored,
//!     its account's limits counted, made attributable, submitted; undone on refusal.
//!   - [`api`]: the HTTP + SSE API (actix-web): validate → submit (to [`admission`]) → respond;
//!     its OpenAPI 3.1 document is generated from the handlers and types (`/openapi.json`).
//!   - [`ui`]: the runs page (`/ui/`), static files embedded in the binary that read `/v1/*`.
//!   - [`agents`]: the agent variant registry (`CLAWMUX_AGENTS_FILE`): which `graphId` runs how.
//!   - [`ephemeral`]: ephemeral runs: one hardened, network-less container per run, its LLM calls
//!     through a per-run unix socket served by the [`proxy`].
//!   - [`proxy`]: the LLM attribution proxy (trace id → live run → billing headers, fail-closed);
//!     [`attribution`] is its registry of live runs, [`audit`] its durable call log, [`remote_runs`]
//!     finds the runs of other replicas in a shared store (any replica's proxy forwards any run's
//!     calls).
//!   - [`server`]: wiring, the restart path (continuing stored runs) and shutdown (hand off or
//!     cancel); [`lease`]: run ownership among replicas on PostgreSQL (renewal, takeover).
//!   - [`relay`]: the host-side git relay (container worktrees, format-patch → am → push → PR),
//!     the `Workspace` the session actors use for branch runs.
//!   - [`tenants`]: API keys scoped to billing accounts, budgets and rate limits, completion
//!     webhooks.
//!   - [`replay`]: the replay gateway (a fake OpenClaw gateway that replays recorded chat streams).
//!   - [`load`]: the load driver (`clawmux load`): clawmux vs. the connection-per-call design.
//!   - [`record`]: `clawmux record`: real gateway runs → a cassette.
//!   - [`cli`]: the command line (`serve`, `demo`, `replay-gateway`, `doctor`, `healthcheck`,
//!     `load`, `record`); [`probe`]: its HTTP probes (`healthcheck`, `doctor`'s LLM upstream check);
//!     [`admin_cli`]: `keys` and `limits`, on the store directly; [`exit`]: the exit codes.

pub mod admin_cli;
pub mod admission;
pub mod agents;
pub mod api;
pub mod attribution;
pub mod audit;
pub mod cli;
pub mod ephemeral;

pub mod config;
pub mod exit;
pub mod expiring;
pub mod log_gate;
pub mod lease;
pub mod load;
pub mod record;
pub mod refname;
pub mod relay;
pub mod remote_runs;
pub mod probe;
pub mod proxy;
pub mod replay;
pub mod request;
pub mod server;
pub mod shards;
pub mod store;
pub mod tenants;
#[cfg(test)]
mod test_http;
pub mod ui;
