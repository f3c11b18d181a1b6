//! A run's event stream: what the store has after `Last-Event-ID`, then live events, until the
//! terminal event (or the client goes, or clawmux stops); and the guard that cancels a run whose
//! caller asked for `onDisconnect: abort` and went away.

use super::{store_unavailable, ApiError, AppState};
use crate::store::live::{Feed, FeedError};
use crate::store::{RunView, StoredEvent};
use actix::Addr;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{web, HttpRequest, HttpResponse, Responder};
use actix_web_lab::sse;
use clawmux_actors::messages::Cancel;
use clawmux_actors::{CancelReason, Registry};
use std::sync::Arc;
use std::time::Duration;

/// One server-sent event of a run's stream (its `id:`, `event:` and `data:` lines; `: keep-alive`
/// comment lines come between events). Only for the OpenAPI document: the stream is written by
/// [`to_sse`] from a [`StoredEvent`].
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct SseEvent {
    /// Per-run sequence number from 1; send the last one seen as `Last-Event-ID` to resume.
    #[schema(pattern = "^[1-9][0-9]*$")]
    id: String,
    /// The event's name.
    event: crate::store::EventName,
    /// One JSON object (docs/API.md, "The SSE stream of a run").
    data: String,
}

/// Comment lines keep quiet streams alive through proxies.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Cancels the run when a caller that asked for `onDisconnect: abort` goes away before the end.
/// A run live here is cancelled through the registry; a run this replica does not own (it was
/// stored for the replica that runs its session or branch key, or its owner died and it awaits
/// takeover) gets an abort recorded in the store, which its owner carries out at its next renewal,
/// like `POST …/abort` on a non-owner; so does a run whose log is here but whose session actor is
/// not (a takeover still handing its runs to the registry, a handoff draining this process).
pub(crate) struct DisconnectGuard {
    pub(crate) run_id: String,
    pub(crate) view: RunView,
    registry: Addr<Registry>,
    store: Arc<crate::store::RunStore>,
    armed: bool,
}

impl DisconnectGuard {
    /// A guard for `view`; `armed`: the caller asked for `onDisconnect: abort`.
    pub(crate) fn new(state: &AppState, view: &RunView, armed: bool) -> Self {
        Self { run_id: view.run_id().to_owned(), view: view.clone(), registry: state.registry.clone(), store: state.store.clone(), armed }
    }

    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        if !self.armed || self.view.is_finished() {
            return;
        }
        tracing::info!(run_id = %self.run_id, "caller disconnected; cancelling the run (onDisconnect: abort)");
        let (store, run_id) = (self.store.clone(), self.run_id.clone());
        let record = |store: Arc<crate::store::RunStore>, run_id: String| async move {
            if let Err(e) = store.request_abort(&run_id, crate::store::AbortReason::Api).await {
                tracing::error!(%run_id, error = %e, "cannot record the abort of a run its disconnected caller asked to cancel");
            }
        };
        match &self.view {
            RunView::Live(log) => {
                let (registry, log) = (self.registry.clone(), log.clone());
                actix_web::rt::spawn(async move {
                    let found = registry.send(Cancel { run_id: run_id.clone(), reason: CancelReason::ClientGone }).await.unwrap_or(false);
                    if abort_for_whoever_continues(found, log.is_ending(), log.is_lost(), store.shared()) {
                        record(store, run_id).await;
                    }
                });
            }
            RunView::Stored(_) => {
                actix_web::rt::spawn(record(store, run_id));
            }
        }
    }
}

/// Whether a disconnected `onDisconnect: abort` caller's run, live here, is to be aborted through
/// the store: its log is here but its actor is not (`!found`: a handoff draining this process, a
/// takeover handing its runs to the registry), so on a shared store whoever continues it must
/// cancel it, as `POST …/abort` has it. Not a finished run, and not one this replica stopped
/// running because another took it over or the store went away (lost, suspended): that ended the
/// caller's stream, the caller did not go away.
fn abort_for_whoever_continues(found: bool, finished: bool, stopped_here: bool, shared: bool) -> bool {
    !found && !finished && !stopped_here && shared
}

struct SseState {
    backlog: std::vec::IntoIter<Arc<StoredEvent>>,
    rx: Option<Feed>,
    /// A run live on another replica: its events come from the store as they are stored.
    follow: Option<Following>,
    last_id: u64,
    done: bool,
    guard: DisconnectGuard,
    stopping: tokio::sync::watch::Receiver<bool>,
}

/// A run followed through the store (live on another replica).
struct Following {
    store: Arc<crate::store::RunStore>,
    /// Bumped by each batch that stores the run's events (see `store::follow`).
    notified: tokio::sync::watch::Receiver<u64>,
}

impl Following {
    /// The run's next stored events after `after`; `None` ends the stream (the store cannot be
    /// read, or the run is gone or ended with no further event: the client re-attaches).
    async fn next(&mut self, run_id: &str, after: u64, stopping: &mut tokio::sync::watch::Receiver<bool>) -> Option<Vec<Arc<StoredEvent>>> {
        loop {
            let woken = tokio::select! {
                biased;
                _ = stopping.wait_for(|s| *s) => return None,
                r = self.notified.changed() => match r {
                    Ok(()) => true,
                    // No notifier (cannot happen while this receiver lives): poll, never spin.
                    Err(_) => {
                        tokio::time::sleep(crate::store::follow::FALLBACK_POLL).await;
                        false
                    }
                },
                _ = tokio::time::sleep(crate::store::follow::FALLBACK_POLL) => false,
            };
            self.notified.borrow_and_update();
            let events = self.store.events(run_id, after).await.ok()?;
            if !events.is_empty() {
                return Some(events.into_iter().map(Arc::new).collect());
            }
            if !woken {
                // Quiet: is the run still going somewhere?
                let row = self.store.view(run_id).await.ok()??;
                if row.is_finished() {
                    // Its end was stored after the read above.
                    let events = self.store.events(run_id, after).await.ok()?;
                    return (!events.is_empty()).then(|| events.into_iter().map(Arc::new).collect());
                }
            }
        }
    }
}

fn to_sse(ev: &StoredEvent) -> sse::Event {
    sse::Event::Data(sse::Data::new(ev.data.clone()).event(ev.name.as_str()).id(ev.id.to_string()))
}

pub(crate) async fn sse_response(
    req: &HttpRequest,
    state: &web::Data<AppState>,
    view: RunView,
    after: u64,
    guard: DisconnectGuard,
) -> Result<HttpResponse, ApiError> {
    let mut follow = None;
    let (backlog, rx) = match &view {
        RunView::Live(log) => log.attach(after),
        // Not live here: what the store has, then, for a run live on another replica, what is
        // stored next until its end; else the stream closes.
        RunView::Stored(row) => {
            if row.finished_at_ms.is_none() {
                // Subscribed before the read: nothing stored in between is missed.
                follow = state.store.follow(&row.run_id).map(|notified| Following { store: state.store.clone(), notified });
            }
            let events = state.store.events(&row.run_id, after).await.map_err(store_unavailable)?;
            (events.into_iter().map(Arc::new).collect(), None)
        }
    };
    let st = SseState { backlog: backlog.into_iter(), rx, follow, last_id: after, done: false, guard, stopping: state.stopping.clone() };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let ev = match st.backlog.next() {
            Some(ev) => ev,
            None if st.follow.is_some() => {
                let run_id = st.guard.run_id.clone();
                let (last_id, mut stopping) = (st.last_id, st.stopping.clone());
                let next = st.follow.as_mut()?.next(&run_id, last_id, &mut stopping).await;
                let Some(events) = next else {
                    // Not the caller's disconnect: the run goes on.
                    st.guard.disarm();
                    return None;
                };
                st.backlog = events.into_iter();
                st.backlog.next()?
            }
            None => loop {
                let rx = st.rx.as_mut()?;
                let next = tokio::select! {
                    // Events first: in cancel mode the runs' terminal events are already in the
                    // channel when `stopping` fires, and a fair choice could end the stream
                    // before them (found as a flaky restart test).
                    biased;
                    r = rx.recv() => r,
                    _ = st.stopping.wait_for(|s| *s) => {
                        // Shutdown: end the stream cleanly, without a terminal event; the client
                        // re-attaches with Last-Event-ID to the next process. The run goes on.
                        st.guard.disarm();
                        return None;
                    }
                };
                match next {
                    Ok(ev) if ev.id <= st.last_id => continue,
                    Ok(ev) => break ev,
                    Err(FeedError::Lagged(n)) => {
                        // Too slow: drop this client (it can re-attach with Last-Event-ID); the
                        // run itself goes on.
                        tracing::warn!(run_id = %st.guard.run_id, skipped = n, "SSE client too slow; disconnecting it");
                        st.guard.disarm();
                        return None;
                    }
                    Err(FeedError::Closed) => {
                        // After the terminal event (already disarmed), or the run stopped here
                        // (lost to another replica, suspended): not the caller's disconnect.
                        st.guard.disarm();
                        return None;
                    }
                }
            },
        };
        st.last_id = ev.id;
        if ev.is_terminal() {
            st.done = true;
            st.guard.disarm();
        }
        Some((to_sse(&ev), st))
    });
    let mut resp = sse::Sse::from_infallible_stream(stream).with_keep_alive(KEEP_ALIVE).respond_to(req);
    resp.headers_mut().insert(header::HeaderName::from_static("x-accel-buffering"), HeaderValue::from_static("no"));
    Ok(resp.map_into_boxed_body())
}

#[cfg(test)]
mod tests {
    use super::abort_for_whoever_continues as abort;

    /// Before, a run suspended by a store outage or taken over by another replica had its abort
    /// recorded when its streaming caller's stream ended: the run was aborted where it went on.
    #[test]
    fn only_a_run_without_an_actor_that_goes_on_here_is_aborted_through_the_store() {
        assert!(abort(false, false, false, true), "no actor (handoff, takeover): recorded for whoever continues it");
        assert!(!abort(false, false, true, true), "lost or suspended here: the stream ended, not the caller");
        assert!(!abort(true, false, false, true), "its actor got the cancel");
        assert!(!abort(false, true, false, true), "finished");
        assert!(!abort(false, false, false, false), "one process: nobody else continues it");
    }
}
