//! `memory:`: the run store in this process's memory (tests, throwaway use). Same semantics as the
//! durable backends; nothing survives a restart.

use super::tenants::{BranchClaim, DeliveryOutcome, KeyRecord, Limits, OutboxItem, TenantStore};
use super::{Applied, ListQuery, RawEvent, Retention, RunRow, Store, StoreError, StoredEvent, Write};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

#[derive(Default)]
struct Inner {
    next_seq: i64,
    runs: HashMap<String, RunRow>,
    by_seq: BTreeMap<i64, String>,
    idempotency: HashMap<(String, String), String>,
    events: HashMap<String, Vec<StoredEvent>>,
    keys: BTreeMap<String, KeyRecord>,
    limits: BTreeMap<String, Limits>,
    spend: HashMap<(String, i64), u64>,
    /// Branch key → the billing account it belongs to.
    /// Branch key → its owning account, the claim that made it theirs, the last claim.
    branch_owners: HashMap<String, (String, String, String)>,
    /// Deliveries: the item, when it is due, delivered, given up, the last error.
    outbox: Vec<(OutboxItem, i64, bool, bool, Option<String>)>,
}

/// The in-memory store.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Inner {
    fn insert(&mut self, row: &RunRow) -> Applied {
        if let Some(key) = &row.idempotency_key {
            if let Some(id) = self.idempotency.get(&(row.billing_account_id.clone(), key.clone())) {
                let Some(existing) = self.runs.get(id) else { return Applied::IdempotencyMismatch };
                return if existing.fingerprint == row.fingerprint {
                    Applied::Existing { run_id: id.clone() }
                } else {
                    Applied::IdempotencyMismatch
                };
            }
        }
        if let Some(existing) = self.runs.get(&row.run_id) {
            return if existing.fingerprint == row.fingerprint {
                Applied::Existing { run_id: row.run_id.clone() }
            } else {
                Applied::Conflict
            };
        }
        self.next_seq += 1;
        let mut row = row.clone();
        row.seq = self.next_seq;
        if let Some(key) = &row.idempotency_key {
            self.idempotency.insert((row.billing_account_id.clone(), key.clone()), row.run_id.clone());
        }
        self.by_seq.insert(row.seq, row.run_id.clone());
        let seq = row.seq;
        self.runs.insert(row.run_id.clone(), row);
        Applied::Inserted { seq }
    }

    fn queue_webhook(&mut self, run_id: &str, w: &super::NewDelivery) {
        let now = super::now_ms();
        let item = OutboxItem {
            id: self.outbox.len() as i64 + 1,
            run_id: run_id.to_owned(),
            url: w.url.clone(),
            key_id: w.key_id.clone(),
            body: w.body.clone(),
            attempts: 0,
            created_at_ms: now,
        };
        self.outbox.push((item, now, false, false, None));
    }

    fn delete(&mut self, run_id: &str) {
        if let Some(row) = self.runs.remove(run_id) {
            self.by_seq.remove(&row.seq);
            if let Some(key) = row.idempotency_key {
                self.idempotency.remove(&(row.billing_account_id, key));
            }
        }
        self.events.remove(run_id);
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn commits_locally(&self) -> bool {
        true
    }

    async fn apply(&self, batch: &[Write]) -> Result<Vec<Applied>, StoreError> {
        let mut st = self.lock();
        let mut out = Vec::with_capacity(batch.len());
        for w in batch {
            out.push(match w {
                Write::Insert(row) => st.insert(row),
                Write::Append { run_id, event, patch, webhook } => {
                    if let Some(w) = webhook {
                        st.queue_webhook(run_id, w);
                    }
                    if let Some(row) = st.runs.get_mut(run_id) {
                        patch.apply(row);
                        if let Some(e) = event {
                            row.last_event_id = row.last_event_id.max(e.id);
                        }
                        if let Some(e) = event {
                            st.events.entry(run_id.clone()).or_default().push(e.clone());
                        }
                    }
                    Applied::Done
                }
                Write::Fail { run_id, event, patch, webhook } => {
                    if let Some(w) = webhook {
                        st.queue_webhook(run_id, w);
                    }
                    if let Some(row) = st.runs.get_mut(run_id) {
                        patch.apply(row);
                        row.last_event_id = event.id;
                        let events = st.events.entry(run_id.clone()).or_default();
                        events.retain(|e| e.id < event.id);
                        events.push(event.clone());
                    }
                    Applied::Done
                }
                Write::Delete { run_id } => {
                    st.delete(run_id);
                    Applied::Done
                }
                // One process, in memory: a write is never applied twice (ids are for ambiguous commits).
                Write::Spend { account, window_start_ms, tokens, .. } => {
                    let t = st.spend.entry((account.clone(), *window_start_ms)).or_default();
                    *t = t.saturating_add(*tokens);
                    Applied::Done
                }
                // One process: its share is the run's usage.
                Write::Usage { run_id, usage } => {
                    if let Some(row) = st.runs.get_mut(run_id) {
                        row.usage = Some(*usage);
                    }
                    Applied::Done
                }
                Write::LlmCall { .. } => Applied::Done,
            });
        }
        Ok(out)
    }

    async fn run(&self, run_id: &str) -> Result<Option<RunRow>, StoreError> {
        Ok(self.lock().runs.get(run_id).cloned())
    }

    async fn by_idempotency_key(&self, account: &str, key: &str) -> Result<Option<RunRow>, StoreError> {
        let inner = self.lock();
        Ok(inner.idempotency.get(&(account.to_owned(), key.to_owned())).and_then(|id| inner.runs.get(id)).cloned())
    }

    async fn events(&self, run_id: &str, after: u64) -> Result<Vec<StoredEvent>, StoreError> {
        Ok(self.lock().events.get(run_id).map(|v| v.iter().filter(|e| e.id > after).cloned().collect()).unwrap_or_default())
    }

    async fn raw_events(&self, run_id: &str, after: u64) -> Result<Vec<RawEvent>, StoreError> {
        let raw = |e: StoredEvent| RawEvent { id: i64::try_from(e.id).unwrap_or(i64::MAX), name: e.name.as_str().to_owned(), data: e.data };
        Ok(self.events(run_id, after).await?.into_iter().map(raw).collect())
    }

    async fn list(&self, q: &ListQuery) -> Result<Vec<RunRow>, StoreError> {
        let st = self.lock();
        let upper = q.before_seq.unwrap_or(i64::MAX);
        Ok(st
            .by_seq
            .range(..upper)
            .rev()
            .filter_map(|(_, id)| st.runs.get(id))
            .filter(|r| q.statuses.is_empty() || q.statuses.contains(&r.status))
            .filter(|r| q.billing_account_id.as_ref().is_none_or(|a| *a == r.billing_account_id))
            .filter(|r| q.accounts.as_ref().is_none_or(|acc| acc.contains(&r.billing_account_id)))
            .filter(|r| q.state_key.is_none() || q.state_key == r.state_key)
            .filter(|r| q.since_ms.is_none_or(|s| r.created_at_ms >= s))
            .take(q.limit)
            .cloned()
            .collect())
    }

    async fn unfinished(&self) -> Result<Vec<RunRow>, StoreError> {
        let st = self.lock();
        Ok(st.by_seq.values().filter_map(|id| st.runs.get(id)).filter(|r| r.finished_at_ms.is_none()).cloned().collect())
    }

    async fn sweep(&self, retention: Retention, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let mut st = self.lock();
        // Each account's finished runs, newest first, as the SQL stores order them (end time, then
        // admission order): past the account's newest `max_count`, or past the age, they go.
        let mut finished: Vec<(&str, std::cmp::Reverse<(i64, i64)>, &str)> = st
            .runs
            .values()
            .filter_map(|r| r.finished_at_ms.map(|t| (r.billing_account_id.as_str(), std::cmp::Reverse((t, r.seq)), r.run_id.as_str())))
            .collect();
        finished.sort_unstable();
        let cutoff = now_ms.saturating_sub(retention.max_age_ms);
        let mut doomed = Vec::new();
        let mut nth = 0usize;
        for (i, &(account, std::cmp::Reverse((t, _)), id)) in finished.iter().enumerate() {
            nth = if i > 0 && finished[i - 1].0 == account { nth + 1 } else { 0 };
            if nth >= retention.max_count || t <= cutoff {
                doomed.push(id.to_owned());
            }
        }
        for id in &doomed {
            st.delete(id);
        }
        Ok(doomed)
    }
}

#[async_trait::async_trait]
impl TenantStore for MemoryStore {
    async fn create_key(&self, key: &KeyRecord) -> Result<(), StoreError> {
        let mut st = self.lock();
        if st.keys.contains_key(&key.id) {
            return Err(StoreError(format!("a key with id {:?} exists", key.id)));
        }
        st.keys.insert(key.id.clone(), key.clone());
        Ok(())
    }

    async fn key(&self, id: &str) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.lock().keys.get(id).cloned())
    }

    async fn claim_branch(&self, branch_key: &str, account: &str, _at_ms: i64, claim: &str) -> Result<BranchClaim, StoreError> {
        let mut st = self.lock();
        let entry = st.branch_owners.entry(branch_key.to_owned()).or_insert_with(|| (account.to_owned(), claim.to_owned(), claim.to_owned()));
        if entry.0 == account {
            claim.clone_into(&mut entry.2);
        }
        Ok(BranchClaim { owner: entry.0.clone(), claimed_now: entry.1 == claim })
    }

    async fn branch_owner(&self, branch_key: &str) -> Result<Option<String>, StoreError> {
        Ok(self.lock().branch_owners.get(branch_key).map(|(owner, _, _)| owner.clone()))
    }

    async fn release_branch(&self, branch_key: &str, claim: &str) -> Result<(), StoreError> {
        let mut st = self.lock();
        if st.branch_owners.get(branch_key).is_some_and(|(_, _, last)| last == claim) {
            st.branch_owners.remove(branch_key);
        }
        Ok(())
    }

    async fn keys(&self) -> Result<Vec<KeyRecord>, StoreError> {
        Ok(self.lock().keys.values().cloned().collect())
    }

    async fn revoke_key(&self, id: &str, at_ms: i64) -> Result<bool, StoreError> {
        let mut st = self.lock();
        if !st.keys.contains_key(id) {
            return Ok(false);
        }
        // The key, the keys it created, theirs, ...
        let mut made = vec![id.to_owned()];
        let mut i = 0;
        while let Some(creator) = made.get(i).cloned() {
            made.extend(st.keys.values().filter(|k| k.created_by.as_deref() == Some(&creator) && !made.contains(&k.id)).map(|k| k.id.clone()).collect::<Vec<_>>());
            i += 1;
        }
        for k in made {
            if let Some(k) = st.keys.get_mut(&k) {
                k.revoked_at_ms.get_or_insert(at_ms);
            }
        }
        Ok(true)
    }

    async fn limits(&self, account: &str) -> Result<Option<Limits>, StoreError> {
        Ok(self.lock().limits.get(account).copied())
    }

    async fn all_limits(&self) -> Result<Vec<(String, Limits)>, StoreError> {
        Ok(self.lock().limits.iter().map(|(a, l)| (a.clone(), *l)).collect())
    }

    async fn set_limits(&self, account: &str, limits: &Limits, _at_ms: i64) -> Result<(), StoreError> {
        self.lock().limits.insert(account.to_owned(), *limits);
        Ok(())
    }

    async fn spend(&self, account: &str, window_start_ms: i64) -> Result<u64, StoreError> {
        Ok(self.lock().spend.get(&(account.to_owned(), window_start_ms)).copied().unwrap_or(0))
    }

    async fn due_deliveries(&self, now_ms: i64, limit: usize) -> Result<Vec<OutboxItem>, StoreError> {
        // Numbered per key in id order, then taken by (number, id), as the SQL stores do.
        let mut per_key: HashMap<Option<String>, usize> = HashMap::new();
        let st = self.lock();
        let mut due: Vec<(usize, i64, &OutboxItem)> = st
            .outbox
            .iter()
            .filter(|o| !o.2 && !o.3 && o.1 <= now_ms)
            .map(|o| {
                let n = per_key.entry(o.0.key_id.clone()).or_default();
                *n += 1;
                (*n, o.0.id, &o.0)
            })
            .filter(|(n, _, _)| *n <= super::tenants::DUE_PER_KEY)
            .collect();
        // Within each round, first attempts and retries taken in turns (each class by id).
        due.sort_by_key(|(n, id, o)| (*n, o.attempts > 0, *id));
        let mut in_class: HashMap<(usize, bool), usize> = HashMap::new();
        let mut turns: Vec<(usize, usize, bool, i64, &OutboxItem)> = due
            .into_iter()
            .map(|(n, id, o)| {
                let retry = o.attempts > 0;
                let k = in_class.entry((n, retry)).or_default();
                *k += 1;
                (n, *k, retry, id, o)
            })
            .collect();
        turns.sort_by_key(|(n, k, retry, id, _)| (*n, *k, *retry, *id));
        Ok(turns.into_iter().take(limit).map(|(_, _, _, _, o)| o.clone()).collect())
    }

    async fn record_delivery(&self, id: i64, outcome: &DeliveryOutcome, _at_ms: i64) -> Result<(), StoreError> {
        let mut st = self.lock();
        if let Some(o) = st.outbox.iter_mut().find(|o| o.0.id == id) {
            o.0.attempts += 1;
            match outcome {
                DeliveryOutcome::Delivered => o.2 = true,
                DeliveryOutcome::Retry { next_at_ms, error } => {
                    o.1 = *next_at_ms;
                    o.4 = Some(error.clone());
                }
                DeliveryOutcome::GaveUp { error } => {
                    o.3 = true;
                    o.4 = Some(error.clone());
                }
            }
        }
        Ok(())
    }

    async fn deliveries_of(&self, run_id: &str) -> Result<Vec<(u32, bool, bool, Option<String>)>, StoreError> {
        Ok(self.lock().outbox.iter().filter(|o| o.0.run_id == run_id).map(|o| (o.0.attempts, o.2, o.3, o.4.clone())).collect())
    }
}
