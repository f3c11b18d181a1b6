//! Admission: the one way a run gets into the registry, for a new request (`POST /v1/runs`) and
//! for a stored run a restart continues.
//!
//! A new run is stored first (idempotency and run-id reuse are decided there), then a branch run's
//! base ref and key are checked with the git relay (a caller's mistake is refused before the run),
//! then its account's limits are checked and counted, then it is made attributable to the LLM proxy and handed to the
//! registry. A refusal at any step undoes the steps before it: the stored row is forgotten, the
//! account's live-run count released, the trace id unregistered. A continued run skips the store
//! insert and the limit checks (it was admitted before) but counts as live for its account.
//!
//! The HTTP layer validates the request, calls [`Admission::submit`] and maps [`Refused`] to an
//! answer; the restart path calls [`Admission::resume`].

use crate::attribution::{Attributions, RunBilling, Usage};
use crate::request::{self, ValidRun};
use crate::store::{BusyPolicy, CheckpointRecord, Insert, RunLog, RunRow, RunStore, RunView, SpecRecord, StoreError, UsageShares};
use crate::tenants::budget::{Budgets, Refusal};
use actix::Addr;
use clawmux_actors::branch::{BranchPlan, Workspace, WorkspaceError};
use clawmux_actors::messages::{AdmitError, Cancel, IfBusy, Submit};
use clawmux_actors::{Admitted, CancelReason, Registry, Resume, ResumeStage, RunSink, RunSpec};
use clawmux_protocol::session_key::Conversation;
use clawmux_protocol::{SessionKey, TraceParent};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long admission waits for the registry before giving up (the caller retries).
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a run is not admitted.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The request (or stored run) cannot become a run.
    #[error("{0}")]
    Invalid(String),
    /// The run store cannot be asked or written.
    #[error("the run store is not available: {0}")]
    Store(StoreError),
    /// The run id exists with a different request body.
    #[error("run {0:?} already exists with a different request body")]
    RunIdConflict(String),
    /// The idempotency key was used with a different request body.
    #[error("this Idempotency-Key was used with a different request body")]
    IdempotencyMismatch,
    /// The account's budget or rate limits.
    #[error("{}", limit_message(.0))]
    Limit(Refusal),
    /// The trace id belongs to another live run (its LLM calls could not be told apart).
    #[error("the traceparent's trace id is in use by live run {owner:?}; concurrent runs need distinct trace ids")]
    TraceInUse {
        /// The live run that owns it.
        owner: String,
    },
    /// The registry refused it.
    #[error("{0}")]
    Registry(AdmitError),
    /// Its session key and branch key are in use by runs on two different replicas.
    #[error("this run's session (stateKey) and its branch each have a run in flight, on two different replicas: it cannot be queued behind both; retry once one of them has finished")]
    KeysOnTwoReplicas,
    /// The registry did not answer in time.
    #[error("clawmux is overloaded; retry shortly")]
    Overloaded,
    /// A branch run's base ref does not exist (the relay's check before the run).
    #[error("field `branch.baseRef`: {0}")]
    UnknownBaseRef(String),
    /// A branch run's key cannot be a branch next to the existing ones (`a` vs `a/b`).
    #[error("field `{field}`: {message}")]
    BranchConflict {
        /// The request field that named the key.
        field: &'static str,
        /// What git would refuse.
        message: String,
    },
}

/// How long a `POST` waits for the relay's checks of a branch run before admitting it unchecked.
const BRANCH_CHECK_TIMEOUT: Duration = Duration::from_secs(20);

fn limit_message(r: &Refusal) -> &str {
    match r {
        Refusal::RateLimited { message, .. } | Refusal::BudgetExceeded { message, .. } | Refusal::Unmetered { message } => message,
    }
}

/// A validated `POST /v1/runs` with what the HTTP layer read besides its body.
pub struct NewRun {
    /// The validated body.
    pub run: ValidRun,
    /// The caller's trace (or a new one): its trace id attributes the run's LLM calls.
    pub traceparent: TraceParent,
    /// `Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// The API key that admitted it (`None`: the admin): it signs the run's webhook.
    pub key_id: Option<String>,
    /// Where the run's end is posted (already checked against the allow-list).
    pub webhook_url: Option<String>,
    /// The base ref of a branch run that names none (`CLAWMUX_RELAY_BASE_REF`).
    pub default_base_ref: String,
}

/// How a submission went.
pub enum Submitted {
    /// A new run, in the registry.
    New {
        /// Its live log.
        log: Arc<RunLog>,
        /// Started or queued behind its session key.
        admitted: Admitted,
    },
    /// The same request was admitted before: this is its run (nothing new was started).
    Existing(RunView),
    /// A new run, stored for the replica that runs the earlier runs of its session or branch key.
    Elsewhere(RunView),
}

/// What admission needs: the store, the registry, the LLM proxy's attributions and the budgets.
pub struct Admission {
    /// Runs: idempotency, documents, live logs.
    store: Arc<RunStore>,
    /// Live runs.
    registry: Addr<Registry>,
    /// Live runs by trace id; `None` without an LLM proxy.
    attributions: Option<Arc<Attributions>>,
    /// Per-account limits, counted here and released when a run ends.
    budgets: Arc<Budgets>,
    /// The git relay, which checks a branch run's base ref and key before it is admitted.
    workspace: Option<Arc<dyn Workspace>>,
    /// The agent variants and the runner of the ephemeral ones: a run of an ephemeral variant
    /// goes there instead of to the registry.
    ephemeral: Option<(crate::agents::AgentRegistry, Arc<crate::ephemeral::Ephemeral>)>,
    /// Admissions (shared) against takeovers (exclusive): a run this replica stores as its own
    /// reaches the registry before a takeover claims later-admitted runs of its session key, and
    /// a takeover hands all it claimed to the registry before a later admission gets there
    /// (session-key FIFO across replicas). A branch run's checks (seconds, at worst) are made
    /// before it takes the gate.
    gate: Arc<tokio::sync::RwLock<()>>,
    /// The HTTP workers that are shards: a run admitted on one lives there.
    shards: Arc<crate::shards::Shards>,
}

impl Admission {
    /// Admission over these parts.
    pub fn new(
        store: Arc<RunStore>,
        registry: Addr<Registry>,
        attributions: Option<Arc<Attributions>>,
        budgets: Arc<Budgets>,
        workspace: Option<Arc<dyn Workspace>>,
    ) -> Self {
        Self { store, registry, attributions, budgets, workspace, ephemeral: None, gate: Arc::default(), shards: Arc::default() }
    }

    /// The shards a run admitted on lives on (see [`crate::shards`]).
    pub fn with_shards(mut self, shards: Arc<crate::shards::Shards>) -> Self {
        self.shards = shards;
        self
    }

    /// Held exclusively by a takeover from its claim until its runs are in the registry.
    pub fn takeover_gate(&self) -> Arc<tokio::sync::RwLock<()>> {
        self.gate.clone()
    }

    /// Sends the runs of `agents`' ephemeral variants to `runner`.
    pub fn with_ephemeral(mut self, agents: crate::agents::AgentRegistry, runner: Arc<crate::ephemeral::Ephemeral>) -> Self {
        self.ephemeral = Some((agents, runner));
        self
    }

    /// The ephemeral variant a run names, with its runner.
    fn ephemeral_of(&self, graph_id: &str) -> Option<(&crate::agents::Agent, crate::agents::EphemeralSpec, &Arc<crate::ephemeral::Ephemeral>)> {
        let (agents, runner) = self.ephemeral.as_ref()?;
        let agent = agents.variant(graph_id)?;
        Some((agent, agent.ephemeral.clone()?, runner))
    }

    /// Stores a new run, checks its account's limits and hands it to the registry; a refusal
    /// leaves nothing behind (no stored row, no live-run count, no attribution, no claim of its
    /// branch key).
    pub async fn submit(&self, new: NewRun) -> Result<Submitted, Refused> {
        // A branch key is its account's (see `claim_branch`): another account's is refused before
        // anything else looks at it, and a key claimed for a run that is then refused is let go
        // (unless a run of the same account claimed it meanwhile: that one may be working on it).
        let claimed = match &new.run.branch_key {
            Some(key) => {
                let account = &new.run.request.billing_account_id;
                let claim_id = uuid::Uuid::new_v4().to_string();
                let claim = self.store.tenants().claim_branch(key, account, crate::store::now_ms(), &claim_id).await.map_err(Refused::Store)?;
                if &claim.owner != account {
                    let field = branch_field(&new.run.request);
                    let message = format!("branch key {key:?} is another billing account's (a branch key belongs to the account that first posted a run on it); use another branch key");
                    return Err(Refused::BranchConflict { field, message });
                }
                claim.claimed_now.then(|| (key.clone(), claim_id))
            }
            None => None,
        };
        let result = self.submit_on_own_branch(new).await;
        if let (Err(_), Some((key, claim_id))) = (&result, claimed) {
            if let Err(e) = self.store.tenants().release_branch(&key, &claim_id).await {
                tracing::warn!(error = %e, "cannot let go of the branch key claimed for a refused run; it stays its account's");
            }
        }
        result
    }

    /// The refusal of a run whose `branch.baseRef` names another account's sandbox branch: its
    /// worktree would start from that account's work, and its pull request would ask to merge
    /// into it. (The server's default base ref is the operator's, not checked.)
    async fn foreign_base_ref(&self, request: &request::RunRequest) -> Result<Option<Refused>, Refused> {
        let base_ref = request.branch.as_ref().and_then(|b| b.base_ref.as_deref());
        let Some((base_ref, key)) = base_ref.and_then(|r| Some((r, crate::refname::sandbox_key_of_base_ref(r)?))) else {
            return Ok(None);
        };
        let owner = self.store.tenants().branch_owner(key).await.map_err(Refused::Store)?;
        Ok(owner.filter(|o| o != &request.billing_account_id).map(|_| Refused::BranchConflict {
            field: "branch.baseRef",
            message: format!("base ref {base_ref:?} is the sandbox branch of another billing account's branch key; start from a branch of your own or a shared one"),
        }))
    }

    /// [`Self::submit`] once the run's branch key (if any) is its account's.
    async fn submit_on_own_branch(&self, new: NewRun) -> Result<Submitted, Refused> {
        let if_busy = match new.run.request.if_busy {
            None | Some(request::IfBusy::Enqueue) => IfBusy::Enqueue,
            Some(request::IfBusy::Reject) => IfBusy::Reject,
            Some(request::IfBusy::Interrupt) => IfBusy::Interrupt,
        };
        let key_field = branch_field(&new.run.request);
        let foreign_base = self.foreign_base_ref(&new.run.request).await?;
        let (spec, row) = spec_and_row(new, self.attributions.is_some())?;
        // What can refuse the run before it is stored is asked first, so a refused run is never
        // stored (where the replica its session key runs on could take it up before it is
        // forgotten): a branch run's checks (seconds, at worst, hence outside the gate: holding
        // it that long would hold up takeovers, and the admissions queued behind a waiting
        // takeover), a base ref that is another account's branch, and a token budget nothing
        // here could count. A request repeating a stored one (same run id or Idempotency-Key, same
        // body) still gets its run.
        let refused_early = match foreign_base {
            Some(refused) => Some(refused),
            None => match (&spec.branch, &self.workspace) {
                (Some(plan), Some(workspace)) => check_branch(workspace.as_ref(), plan, key_field).await.err(),
                _ => None,
            },
        }
        .or_else(|| self.budgets.unmetered(&spec.billing_account_id).map(Refused::Limit));
        if let Some(refused) = refused_early {
            return match self.replayed(&RequestKey::of(&row)).await.map_err(Refused::Store)? {
                Some(repeat) => repeat,
                None => Err(refused),
            };
        }
        // From the insert until the registry has the run, no takeover here: a run of its session
        // or branch key admitted after it elsewhere (and given to this replica) cannot start first.
        let gate = self.gate.clone();
        let _admitting = gate.read().await;
        if self.store.suspended() > 0 {
            // This replica's runs were suspended while the store was out of reach and are being
            // taken back: a run of one of their keys admitted now could start before them.
            return Err(Refused::Store(StoreError("the run store was out of reach; this replica is taking its runs back, retry in a moment".to_owned())));
        }
        let run_id = spec.run_id.clone();
        let account = spec.billing_account_id.clone();
        // What finds a stored run of this request (not the row: its spec holds the whole message).
        let repeat = RequestKey::of(&row);
        let log = match self.store.insert(row).await.map_err(Refused::Store)? {
            Insert::New(log) => log,
            Insert::Existing(view) => return Ok(Submitted::Existing(view)),
            // Its owner starts it after the earlier runs of its keys; the store counted its
            // account's limits and budget over every replica in the same transaction.
            Insert::Assigned(view) => return Ok(Submitted::Elsewhere(view)),
            // `ifBusy: reject` and the session key is busy on another replica (the store decided).
            Insert::SessionBusy => return Err(Refused::Registry(AdmitError::SessionBusy)),
            // Decided before the store looked for a stored run of the request: a repeat gets its run.
            Insert::KeysOnTwoReplicas => {
                return match self.replayed(&repeat).await.map_err(Refused::Store)? {
                    Some(answer) => answer,
                    None => Err(Refused::KeysOnTwoReplicas),
                }
            }
            Insert::Limited { budget: false, message, retry_after_sec } => return Err(Refused::Limit(Refusal::RateLimited { message, retry_after_sec })),
            Insert::Limited { budget: true, message, retry_after_sec } => return Err(Refused::Limit(Refusal::BudgetExceeded { message, retry_after_sec })),
            Insert::Conflict => return Err(Refused::RunIdConflict(run_id)),
            Insert::IdempotencyMismatch => return Err(Refused::IdempotencyMismatch),
            // A live run of another replica has the trace id (the store's constraint said so).
            Insert::TraceInUse(owner) => return Err(Refused::TraceInUse { owner }),
        };
        // Checked and counted under one lock per account: a burst is counted exactly.
        let limited = match self.budgets.admit(&account, &run_id).await {
            Ok(Ok(())) => None,
            Ok(Err(refusal)) => Some(Refused::Limit(refusal)),
            Err(e) => Some(Refused::Store(e)),
        };
        if let Some(refused) = limited {
            self.store.forget(&run_id).await;
            return Err(refused);
        }
        match self.hand_over(&log, spec, None, if_busy, UsageShares::default()).await {
            Ok(admitted) => Ok(Submitted::New { log, admitted }),
            Err(e) => {
                self.budgets.release(&account, &run_id);
                self.store.forget(&run_id).await;
                Err(e)
            }
        }
    }

    /// The answer to a request that repeats a stored one (its run id or its `Idempotency-Key`),
    /// as the store's insert would give it: the stored run for the same body, a conflict for
    /// another; `None` for a new request.
    async fn replayed(&self, row: &RequestKey) -> Result<Option<Result<Submitted, Refused>>, StoreError> {
        let stored = match &row.idempotency_key {
            Some(key) => self.store.by_idempotency_key(&row.billing_account_id, key).await?,
            None => None,
        };
        if let Some(stored) = stored {
            return Ok(Some(match stored.fingerprint == row.fingerprint {
                true => self.store.view(&stored.run_id).await?.map(Submitted::Existing).ok_or(Refused::IdempotencyMismatch),
                false => Err(Refused::IdempotencyMismatch),
            }));
        }
        Ok(match self.store.view(&row.run_id).await? {
            Some(view) if view.fingerprint() == row.fingerprint => Some(Ok(Submitted::Existing(view))),
            Some(_) => Some(Err(Refused::RunIdConflict(row.run_id.clone()))),
            None => None,
        })
    }

    /// Continues a stored, unfinished run after a restart, where its checkpoint says.
    pub async fn resume(&self, log: &Arc<RunLog>, row: &RunRow) -> Result<Admitted, Refused> {
        let spec = spec_of(row).map_err(Refused::Invalid)?;
        if self.ephemeral_of(&spec.graph_id).is_some() {
            // Its container was removed with the crash (orphans are reaped at start): the agent's
            // work is gone, and running it again could repeat what it already did.
            return Err(Refused::Invalid("an ephemeral run's container does not survive a restart of clawmux; it was removed".to_owned()));
        }
        let resume = resume_of(row, log);
        // A run admitted before branch keys had owners (or by a replica of that version) claims its
        // key now, so another account cannot take it while the run works on it.
        if let Some(plan) = &spec.branch {
            match self.store.tenants().claim_branch(&plan.key, &spec.billing_account_id, crate::store::now_ms(), &uuid::Uuid::new_v4().to_string()).await {
                Ok(claim) if claim.owner != spec.billing_account_id => {
                    tracing::warn!(run_id = %spec.run_id, "the run's branch key is another billing account's (claimed meanwhile); the run goes on");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(run_id = %spec.run_id, error = %e, "cannot claim the continued run's branch key"),
            }
        }
        // Its usage continues from this process's stored share; the other replicas' shares (a
        // shared store: calls their proxies forwarded, an old owner's) count in its documents.
        let shares = match self.attributions {
            Some(_) => self.store.usage_shares(&row.run_id, row.usage).await.map_err(Refused::Store)?,
            None => UsageShares::default(),
        };
        // A continued run counts as live for its account's limits, without the checks.
        self.budgets.resume(&spec.billing_account_id, &spec.run_id);
        // A run that asked to interrupt its session and has not started yet (stored for the
        // replica its session key runs on, taken up there now; or queued at a restart) does so
        // here; `reject` was decided at admission.
        let if_busy = if row.spec.if_busy == BusyPolicy::Interrupt && row.checkpoint.is_none() { IfBusy::Interrupt } else { IfBusy::Enqueue };
        self.hand_over(log, spec, Some(resume), if_busy, shares).await
    }

    /// Makes a stored run attributable (its usage continuing from `shares`) and hands it to the
    /// registry.
    async fn hand_over(&self, log: &Arc<RunLog>, spec: RunSpec, resume: Option<Resume>, if_busy: IfBusy, shares: UsageShares) -> Result<Admitted, Refused> {
        let trace_id = spec.traceparent.trace_id().to_owned();
        {
            let (budgets, account, run_id) = (self.budgets.clone(), spec.billing_account_id.clone(), spec.run_id.clone());
            log.on_end(Box::new(move || budgets.release(&account, &run_id)));
        }
        let mut run_billing = None;
        if let Some(attributions) = &self.attributions {
            // Attributable before admission: the gateway may call the LLM as soon as `agent` is sent.
            let mut billing = RunBilling::new(&spec.run_id, &spec.billing_account_id, &spec.graph_id, spec.session_key.as_str(), &trace_id);
            if let Some(t) = &spec.attribution_token {
                billing = billing.with_token(t.clone());
            }
            // A run this process forwarded calls of as another replica's (taken over now) keeps
            // those counters: `register` gives them back.
            let billing = match attributions.register(Arc::new(billing.with_usage(shares.mine))) {
                Ok(b) => b,
                Err(owner) => return Err(Refused::TraceInUse { owner }),
            };
            for (replica, share) in &shares.others {
                billing.note_share(replica, *share);
            }
            let (b, a) = (self.budgets.clone(), spec.billing_account_id.clone());
            log.set_billing(billing.clone(), attributions.clone(), Some(Box::new(move |tokens| b.record(&a, tokens))));
            run_billing = Some(billing);
        }
        let run_id = spec.run_id.clone();
        let registry = self.registry.clone();
        let cancel_id = run_id.clone();
        log.on_failure(Box::new(move || registry.do_send(Cancel { run_id: cancel_id.clone(), reason: CancelReason::Api })));
        let (registry, lost_id) = (self.registry.clone(), run_id.clone());
        log.on_lost(Box::new(move || registry.do_send(clawmux_actors::messages::HandOff { run_id: lost_id.clone() })));
        let sink: Arc<dyn RunSink> = log.clone();
        // An ephemeral variant's run gets a container run's actor instead of a session actor; the
        // registry owns it just the same.
        let mut slots_taken = false;
        let external = self.ephemeral_of(&spec.graph_id).map(|(agent, variant, runner)| {
            slots_taken = !runner.has_free_slot();
            let job = crate::ephemeral::Job { spec: spec.clone(), agent_id: agent.agent_id.clone(), variant, sink: sink.clone(), billing: run_billing };
            let runner = runner.clone();
            let start: clawmux_actors::messages::ExternalStart = Box::new(move |port| crate::ephemeral::ContainerRun::start(runner, job, port));
            start
        });
        // Admitted on a shard (an HTTP worker): it lives there, beside its log's lane and its
        // caller's stream; a run continued from the store goes to the registry's shards.
        let here = self.shards.here_indexed();
        let shard = here.as_ref().map(|(_, arbiter)| arbiter.clone());
        let admitted = self.registry.send(Submit { spec, sink, resume, if_busy, external, shard }).timeout(REGISTRY_TIMEOUT).await;
        if let (Some((i, _)), Ok(Ok(_))) = (&here, &admitted) {
            self.shards.admitted(*i);
        }
        // Queued while every container slot is taken (its document says `queued` until then).
        let admitted = admitted.map(|a| a.map(|a| if slots_taken { Admitted::Queued } else { a }));
        let refused = match admitted {
            Ok(Ok(admitted)) => return Ok(admitted),
            Ok(Err(e)) => Refused::Registry(e),
            Err(_) => Refused::Overloaded,
        };
        if let Some(attributions) = &self.attributions {
            attributions.unregister(&trace_id, &run_id);
        }
        Err(refused)
    }
}

/// The request field that named the branch key.
fn branch_field(r: &request::RunRequest) -> &'static str {
    match &r.branch {
        Some(b) if b.branch_name.is_some() => "branch.branchName",
        Some(b) if b.work_item_id.is_some() => "branch.workItemId",
        _ => "stateKey",
    }
}

/// A caller's mistake the relay can see before the run; a check that cannot be made (the engine,
/// the remote) admits the run, whose own steps then report what fails.
async fn check_branch(workspace: &dyn Workspace, plan: &BranchPlan, field: &'static str) -> Result<(), Refused> {
    match tokio::time::timeout(BRANCH_CHECK_TIMEOUT, workspace.check(plan)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(WorkspaceError::UnknownBaseRef(m))) => Err(Refused::UnknownBaseRef(m)),
        Ok(Err(WorkspaceError::KeyConflict(message))) => Err(Refused::BranchConflict { field, message }),
        Ok(Err(WorkspaceError::Failed(m))) => {
            tracing::warn!(branch = %plan.branch(), error = %m, "cannot check the branch before the run; admitting it");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(branch = %plan.branch(), "the branch checks took longer than {BRANCH_CHECK_TIMEOUT:?}; admitting the run");
            Ok(())
        }
    }
}

/// The spec of a new run and the row that stores it.
fn spec_and_row(new: NewRun, proxied: bool) -> Result<(RunSpec, RunRow), Refused> {
    let NewRun { run, traceparent, idempotency_key, key_id, webhook_url, default_base_ref } = new;
    let conversation = match run.request.state_key.as_deref() {
        Some(state) => Conversation::State(state),
        None => Conversation::Run(&run.run_id),
    };
    let session_key = SessionKey::for_run(&run.agent_id, &run.request.billing_account_id, conversation)
        .map_err(|e| Refused::Invalid(format!("cannot name the run's session: {e}")))?;
    let branch = run.branch_key.as_ref().map(|key| {
        let b = run.request.branch.clone().unwrap_or_default();
        clawmux_actors::branch::BranchPlan { key: key.clone(), base_ref: b.base_ref.unwrap_or(default_base_ref), pr_title: b.pr_title, pr_body: b.pr_body }
    });
    let spec = RunSpec {
        run_id: run.run_id.clone(),
        // Fixed at admission and stored: a restart sends the same idempotency key, never a new one.
        gateway_run_id: uuid::Uuid::new_v4().to_string(),
        session_key,
        agent_id: run.agent_id.clone(),
        message: run.request.message.clone(),
        model: run.request.model.clone(),
        billing_account_id: run.request.billing_account_id.clone(),
        graph_id: run.graph_id.clone(),
        admitted_at: SystemTime::now(),
        timeout: Duration::from_secs(run.timeout_sec),
        traceparent,
        attribution_token: proxied.then(crate::attribution::new_token),
        branch,
    };
    let row = RunRow {
        seq: 0,
        run_id: run.run_id.clone(),
        idempotency_key,
        fingerprint: request::fingerprint(&run.request),
        billing_account_id: run.request.billing_account_id.clone(),
        state_key: run.request.state_key.clone(),
        session_key: spec.session_key.as_str().to_owned(),
        spec: SpecRecord {
            gateway_run_id: spec.gateway_run_id.clone(),
            agent_id: spec.agent_id.clone(),
            message: spec.message.clone(),
            model: spec.model.clone(),
            graph_id: spec.graph_id.clone(),
            timeout_ms: u64::try_from(spec.timeout.as_millis()).unwrap_or(u64::MAX),
            traceparent: spec.traceparent.to_string(),
            attribution_token: spec.attribution_token.clone(),
            branch: spec.branch.clone(),
            abort_on_disconnect: run.on_disconnect == request::OnDisconnect::Abort,
            if_busy: match run.request.if_busy {
                None | Some(request::IfBusy::Enqueue) => BusyPolicy::Enqueue,
                Some(request::IfBusy::Reject) => BusyPolicy::Reject,
                Some(request::IfBusy::Interrupt) => BusyPolicy::Interrupt,
            },
        },
        status: "queued".to_owned(),
        checkpoint: None,
        gateway_run_id: None,
        content: String::new(),
        error: None,
        gateway_usage: None,
        usage: proxied.then(Usage::default),
        relay: None,
        created_at_ms: crate::store::now_ms(),
        finished_at_ms: None,
        last_event_id: 0,
        key_id,
        webhook_url,
    };
    Ok((spec, row))
}

/// The spec of a stored run.
fn spec_of(row: &RunRow) -> Result<RunSpec, String> {
    let traceparent = TraceParent::parse(&row.spec.traceparent).map_err(|e| format!("stored traceparent: {e}"))?;
    let created = UNIX_EPOCH + Duration::from_millis(u64::try_from(row.created_at_ms).unwrap_or(0));
    Ok(RunSpec {
        run_id: row.run_id.clone(),
        gateway_run_id: row.spec.gateway_run_id.clone(),
        session_key: SessionKey::canonicalize(&row.session_key),
        agent_id: row.spec.agent_id.clone(),
        message: row.spec.message.clone(),
        model: row.spec.model.clone(),
        billing_account_id: row.billing_account_id.clone(),
        graph_id: row.spec.graph_id.clone(),
        admitted_at: created.min(SystemTime::now()),
        timeout: Duration::from_millis(row.spec.timeout_ms),
        traceparent,
        attribution_token: row.spec.attribution_token.clone(),
        branch: row.spec.branch.clone(),
    })
}

/// Where a stored run picks up.
fn resume_of(row: &RunRow, log: &RunLog) -> Resume {
    let stage = match &row.checkpoint {
        None | Some(CheckpointRecord::Running | CheckpointRecord::Preparing) => ResumeStage::Start,
        Some(CheckpointRecord::Sending { boot_id }) => ResumeStage::Sent { boot_id: boot_id.clone() },
        Some(CheckpointRecord::Publishing { content, gateway_usage }) => {
            ResumeStage::Publishing { content: content.clone(), gateway_usage: *gateway_usage }
        }
    };
    Resume { stage, emitted: log.emitted_text(), accepted: log.was_accepted() }
}

/// What names a request among the stored runs: its run id, and its account's `Idempotency-Key`
/// with the body's fingerprint (see `Admission::replayed`).
struct RequestKey {
    run_id: String,
    billing_account_id: String,
    idempotency_key: Option<String>,
    fingerprint: String,
}

impl RequestKey {
    fn of(row: &RunRow) -> Self {
        Self {
            run_id: row.run_id.clone(),
            billing_account_id: row.billing_account_id.clone(),
            idempotency_key: row.idempotency_key.clone(),
            fingerprint: row.fingerprint.clone(),
        }
    }
}
