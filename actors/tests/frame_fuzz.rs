//! Frame fuzzer: arbitrary gateway frames through the decoder, the fail-closed router, and the
//! real supervisor actor.
//!
//! Properties, over generated frames that mix well-formed frames of registered runs with foreign,
//! near-miss (upper-cased, prefixed, truncated), mistyped and missing keys, random JSON and random
//! text:
//! - decoding never panics, and a frame over the size limit is refused before it is parsed;
//! - a frame is delivered only to the run whose session key AND run id it carries, byte for byte;
//! - a frame that is not delivered is dropped with a reason, never routed elsewhere;
//! - the SUPERVISOR, fed generated frame sequences (answers to its pending requests, answers for
//!   nobody, shutdowns with reconnects) over a real WebSocket from a loopback gateway, delivers
//!   every event to exactly the run it addresses and every answer to exactly the caller whose
//!   request id it carries, as often as a model of the protocol says, and nothing else; it
//!   survives every sequence (it still answers afterwards);
//! - its memory is bounded: frames add no routes and no pending requests; an `agent` request whose
//!   caller is gone is forgotten; gateway runs remembered during an outage are capped.
//!
//! The whole path through the real supervisor (socket, decode, route, session actor, SSE) is also
//! fuzzed in `tests/chaos.rs` with a hostile replay gateway.

mod loopback;

use actix::prelude::*;
use clawmux_actors::backoff::Backoff;
use clawmux_actors::messages::{Abandon, AddRoute, Call, Wait};
use clawmux_actors::metrics::Metrics;
use clawmux_actors::routes::RouteTable;
use clawmux_actors::supervisor::{Stats, MAX_ABANDONED};
use clawmux_actors::{StatusHandle, Supervisor, SupervisorConfig};
use clawmux_protocol::{decode_frame, DecodeError, Frame, GatewayEvent, SessionKey};
use loopback::{CallProbe, Got, Leave, Loopback, Replies, RunProbe, SeenEvents, WAIT};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

/// The runs registered in the router: (session key, run id).
const RUNS: [(&str, &str); 3] = [
    ("agent:main:clawmux:acct-a.r.run-1", "g-1"),
    ("agent:main:clawmux:acct-a.s.chat", "g-2"),
    ("agent:main:clawmux:acct-b.r.run-1", "g-3"),
];

fn key_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].0)),
        1 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].0.to_uppercase())),
        1 => (0..RUNS.len()).prop_map(|i| json!(format!("{} ", RUNS[i].0))),
        1 => (0..RUNS.len()).prop_map(|i| json!(&RUNS[i].0[..RUNS[i].0.len() - 1])),
        1 => "[a-z:.]{0,20}".prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any::<i64>().prop_map(Value::from),
        1 => Just(json!(["agent:main:clawmux:acct-a.r.run-1"])),
    ]
}

fn run_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].1)),
        1 => (0..RUNS.len()).prop_map(|i| json!(RUNS[i].1.to_uppercase())),
        1 => "[a-z0-9-]{0,8}".prop_map(Value::from),
        1 => Just(Value::Null),
        1 => any::<u64>().prop_map(Value::from),
    ]
}

fn small_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-zA-Z]{1,8}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A run-scoped event with generated addressing (fields sometimes missing).
fn run_event() -> impl Strategy<Value = Value> {
    (
        prop_oneof![Just("chat"), Just("agent")],
        prop::option::of(key_value()),
        prop::option::of(run_value()),
        prop_oneof![Just("delta"), Just("final"), Just("aborted"), Just("error"), Just("sideways")],
        ".{0,16}",
        any::<u64>(),
        small_json(),
    )
        .prop_map(|(event, key, run, state, text, seq, extra)| {
            let mut payload = serde_json::Map::new();
            if let Some(k) = key {
                payload.insert("sessionKey".into(), k);
            }
            if let Some(r) = run {
                payload.insert("runId".into(), r);
            }
            payload.insert("seq".into(), json!(seq));
            if event == "chat" {
                payload.insert("state".into(), json!(state));
                payload.insert("message".into(), json!({"role": "assistant", "content": [{"type": "text", "text": text}]}));
            } else {
                payload.insert("stream".into(), json!("assistant"));
                payload.insert("data".into(), json!({"text": text}));
            }
            payload.insert("extra".into(), extra);
            json!({"type": "event", "event": event, "payload": Value::Object(payload), "seq": seq})
        })
}

fn any_frame() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => run_event().prop_map(|v| v.to_string()),
        1 => (prop_oneof![Just("tick"), Just("shutdown"), Just("health"), Just("connect.challenge"), Just("x.y")], small_json())
            .prop_map(|(e, p)| json!({"type": "event", "event": e, "payload": p}).to_string()),
        1 => (".{0,10}", any::<bool>(), small_json())
            .prop_map(|(id, ok, p)| json!({"type": "res", "id": id, "ok": ok, "payload": p, "error": p}).to_string()),
        1 => small_json().prop_map(|v| v.to_string()),
        1 => ".{0,64}",
    ]
}

fn router() -> RouteTable<usize> {
    let mut t = RouteTable::new();
    for (i, (k, r)) in RUNS.iter().enumerate() {
        t.insert(k, r, i);
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    #[test]
    fn a_frame_reaches_only_the_run_it_addresses(text in any_frame()) {
        let table = router();
        let Ok(Frame::Event(ev)) = decode_frame(&text, 1 << 20) else { return Ok(()) };
        let Some((key, run)) = ev.event.route_key() else { return Ok(()) };
        if let Ok(&i) = table.route(key, run) {
            // Delivered: the frame's own fields, as sent, name exactly this run.
            let raw: Value = serde_json::from_str(&text).expect("decoded frames are JSON");
            prop_assert_eq!(raw["payload"]["sessionKey"].as_str(), Some(RUNS[i].0));
            prop_assert_eq!(raw["payload"]["runId"].as_str(), Some(RUNS[i].1));
            prop_assert!(matches!(ev.event, GatewayEvent::Chat(_) | GatewayEvent::Agent(_)));
        }
    }

    #[test]
    fn oversize_frames_are_refused_before_parsing(text in any_frame(), max in 0usize..64) {
        match decode_frame(&text, max) {
            Err(DecodeError::TooLarge { size, max: m }) => prop_assert!(size > m && m == max),
            _ => prop_assert!(text.len() <= max, "a {}-byte frame passed a {max}-byte limit", text.len()),
        }
    }
}

/// Regression: not JSON at all, or JSON of the wrong shape, is an error, never a panic.
#[test]
fn garbage_is_an_error() {
    for text in ["", "{", "null", "[]", "{\"type\":5}", "{\"type\":\"event\"}", "\u{0}", "{\"type\":\"res\",\"id\":\"x\"}"] {
        assert!(decode_frame(text, 1024).is_err(), "{text:?}");
    }
}

// ------------------------------------------------------------------------------------------------
// The supervisor actor, fed over a real WebSocket
// ------------------------------------------------------------------------------------------------

/// The calls a test makes before the frames flow: `agent` (answered twice, no deadline of its
/// own), `agent.wait` (a long deadline) and `health` (the default deadline, never reached here).
const CALLS: [(&str, Wait); 3] = [("agent", Wait::Caller), ("agent.wait", Wait::Up(Duration::from_secs(600))), ("health", Wait::Default)];

/// A chat delta to `RUNS[i]` with `text` (the sentinel that shows every frame before it was handled).
fn chat_to(i: usize, text: &str) -> String {
    json!({"type": "event", "event": "chat", "payload": {
        "sessionKey": RUNS[i].0, "runId": RUNS[i].1, "state": "delta",
        "message": {"role": "assistant", "content": [{"type": "text", "text": text}]},
    }})
    .to_string()
}

const SENTINEL: &str = "\u{1}sentinel\u{1}";

/// A started supervisor (fast reconnects, no request times out during a test) and its status.
fn supervisor(url: &str) -> (Addr<Supervisor>, StatusHandle) {
    let mut cfg = SupervisorConfig::new(url);
    cfg.backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(20), 2.0, 0.0).expect("backoff");
    cfg.request_timeout = Duration::from_secs(600);
    cfg.handshake_timeout = Duration::from_secs(5);
    let status = StatusHandle::default();
    (Supervisor::new(cfg, Metrics::unregistered(), status.clone()).start(), status)
}

async fn until_connected(status: &StatusHandle) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !status.read().map(|s| s.connected).unwrap_or(false) {
        assert!(tokio::time::Instant::now() < deadline, "the supervisor did not connect within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Run probes registered for every run of [`RUNS`].
fn route_probes(sup: &Addr<Supervisor>) -> Vec<Addr<RunProbe>> {
    RUNS.iter()
        .map(|(key, run)| {
            let probe = RunProbe::default().start();
            sup.do_send(AddRoute { session_key: SessionKey::canonicalize(key), gateway_run_id: (*run).to_owned(), to: probe.clone().recipient() });
            probe
        })
        .collect()
}

/// Sends the sentinel to `RUNS[0]` and waits (bounded) until its probe has it: every frame queued
/// before was handled by the supervisor, and every event it routed is in its probe's mailbox.
async fn sentinel(gw: &Loopback, probe0: &Addr<RunProbe>) {
    gw.send(chat_to(0, SENTINEL));
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let seen = probe0.send(SeenEvents).await.expect("probe alive");
        if seen.iter().any(|e| e.text.as_deref() == Some(SENTINEL)) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the sentinel did not reach its run within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Ends the case's actix system (and the supervisor's I/O thread with it).
async fn stop_system() {
    System::current().stop();
    tokio::time::sleep(Duration::from_millis(5)).await;
}

/// What the protocol says the supervisor must deliver for `frames`, given the pending requests
/// `ids` (request id → (caller index, is `agent`)): events per run of [`RUNS`], replies per caller,
/// and the requests still pending at the end.
struct Expected {
    /// Events each run of [`RUNS`] must get.
    events: [usize; 3],
    /// Replies each caller of [`CALLS`] must get, in order.
    replies: Vec<Vec<Got>>,
    /// Requests still waiting for an answer at the end (the supervisor must hold exactly these).
    pending: usize,
    /// Shutdowns the supervisor must have taken (each one is a reconnect).
    shutdowns: usize,
}

fn expected(frames: &[String], mut ids: HashMap<String, (usize, bool)>) -> Expected {
    let max = clawmux_actors::limits::max_payload(loopback::MAX_PAYLOAD);
    let mut out = Expected { events: [0; 3], replies: vec![Vec::new(); CALLS.len()], pending: 0, shutdowns: 0 };
    for f in frames {
        match decode_frame(f, max) {
            Ok(Frame::Res(res)) => {
                let Some(&(k, agent)) = ids.get(&res.id) else { continue };
                let status = res.payload.as_ref().and_then(|p| serde_json::from_str::<Value>(p.get()).ok()).and_then(|v| v.get("status").cloned());
                let ack = agent && res.ok && status.as_ref().and_then(Value::as_str) == Some("accepted");
                if !ack {
                    ids.remove(&res.id);
                }
                out.replies[k].push(match (res.ok, res.payload, res.error) {
                    (true, Some(p), _) => Got::Ok(p.get().to_owned()),
                    (true, None, _) => Got::Malformed,
                    (false, _, e) => Got::Gateway(e.map(|e| e.code).unwrap_or_default()),
                });
            }
            // An answer whose id reads but whose body does not: its caller is told, once.
            Err(clawmux_protocol::DecodeError::MalformedResponse { id, .. }) => {
                if let Some((k, _)) = ids.remove(&id) {
                    out.replies[k].push(Got::Malformed);
                }
            }
            Ok(Frame::Event(ev)) => match ev.event {
                GatewayEvent::Chat(_) | GatewayEvent::Agent(_) => {
                    // Judged on the frame as sent (not as decoded): both keys, byte for byte.
                    let raw: Value = serde_json::from_str(f).expect("decoded frames are JSON");
                    let (key, run) = (raw["payload"]["sessionKey"].as_str(), raw["payload"]["runId"].as_str());
                    if let Some(i) = RUNS.iter().position(|(k, r)| Some(*k) == key && Some(*r) == run) {
                        out.events[i] += 1;
                    }
                }
                GatewayEvent::Shutdown(_) => {
                    out.shutdowns += 1;
                    for (_, (k, _)) in ids.drain() {
                        out.replies[k].push(Got::Disconnected);
                    }
                }
                _ => {}
            },
            _ => {}
        }
    }
    out.pending = ids.len();
    out
}

/// An answer to one of the test's calls (`cm-1` .. `cm-3` in the order they were made), or to a
/// request that does not exist; ACKs, finals, errors, payloads of any shape or none.
fn res_frame() -> impl Strategy<Value = String> {
    let id = prop_oneof![6 => (1..=CALLS.len() + 1).prop_map(|n| format!("cm-{n}")), 1 => ".{0,6}"];
    let payload = prop_oneof![
        3 => Just(json!({"runId": "g-1", "sessionKey": RUNS[0].0, "status": "accepted", "acceptedAt": 1})),
        2 => Just(json!({"runId": "g-1", "status": "ok", "result": {"payloads": [{"text": "done"}]}})),
        1 => Just(json!({"status": ["accepted"]})),
        1 => Just(Value::Null),
        2 => small_json(),
    ];
    let error = prop_oneof![
        3 => Just(json!({"code": "UNAVAILABLE", "message": "busy", "retryable": true, "retryAfterMs": -1})),
        1 => Just(json!({"code": "INVALID_REQUEST", "message": "no"})),
        // Errors that do not decode: their answer still reaches its caller (as malformed).
        1 => Just(json!({"code": "UNAVAILABLE", "message": "busy", "retryable": "true"})),
        1 => Just(json!({"message": "no code"})),
        1 => small_json(),
    ];
    (id, any::<bool>(), payload, prop::option::of(error)).prop_map(|(id, ok, payload, error)| {
        let mut f = json!({"type": "res", "id": id, "ok": ok, "payload": payload});
        if let Some(e) = error {
            f["error"] = e;
        }
        f.to_string()
    })
}

/// A well-formed event of one of [`RUNS`] (both keys right), so sequences deliver often.
fn addressed_event() -> impl Strategy<Value = String> {
    (0..RUNS.len(), any::<bool>(), ".{0,8}").prop_map(|(i, chat, text)| {
        let (key, run) = RUNS[i];
        let payload = if chat {
            json!({"sessionKey": key, "runId": run, "state": "delta", "message": {"role": "assistant", "content": [{"type": "text", "text": text}]}})
        } else {
            json!({"sessionKey": key, "runId": run, "stream": "lifecycle", "data": {"phase": "start"}})
        };
        json!({"type": "event", "event": if chat { "chat" } else { "agent" }, "payload": payload}).to_string()
    })
}

fn supervisor_frames() -> impl Strategy<Value = Vec<String>> {
    let shutdown = prop_oneof![Just(0u64), Just(u64::MAX)]
        .prop_map(|ms| json!({"type": "event", "event": "shutdown", "payload": {"reason": "restart", "restartExpectedMs": ms}}).to_string());
    prop::collection::vec(
        prop_oneof![
            8 => run_event().prop_map(|v| v.to_string()),
            4 => addressed_event(),
            4 => res_frame(),
            3 => any_frame(),
            1 => shutdown,
        ],
        0..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The real supervisor, fed a generated frame sequence over a WebSocket, delivers each event
    /// to the run it addresses and each answer to the caller whose request it answers, exactly as
    /// often as the protocol says, and nothing else; it survives the sequence (it still routes,
    /// answers and reconnected after every shutdown) and holds no more than it should.
    #[test]
    fn the_supervisor_delivers_each_frame_only_where_it_belongs(frames in supervisor_frames()) {
        actix_rt::System::new().block_on(async move {
            let gw = Loopback::start().await;
            let (sup, status) = supervisor(&gw.url);
            until_connected(&status).await;
            let runs = route_probes(&sup);
            let callers: Vec<Addr<CallProbe>> = CALLS.iter().map(|_| CallProbe::default().start()).collect();
            for (k, (method, wait)) in CALLS.iter().enumerate() {
                let mut call = Call::new(method, json!({}), k as u64, Some(callers[k].clone().recipient()));
                call.wait = *wait;
                sup.do_send(call);
            }
            gw.wait_requests(CALLS.len()).await;
            let ids: HashMap<String, (usize, bool)> = gw
                .requests()
                .into_iter()
                .map(|(method, id)| {
                    let k = CALLS.iter().position(|(m, _)| *m == method).expect("only the test's calls");
                    (id, (k, method == "agent"))
                })
                .collect();
            let want = expected(&frames, ids);
            for f in &frames {
                gw.send(f.clone());
            }
            sentinel(&gw, &runs[0]).await;

            for (i, probe) in runs.iter().enumerate() {
                let seen: Vec<_> = probe.send(SeenEvents).await.expect("probe").into_iter().filter(|e| e.text.as_deref() != Some(SENTINEL)).collect();
                for e in &seen {
                    prop_assert_eq!((e.session_key.as_deref(), e.run_id.as_deref()), (Some(RUNS[i].0), Some(RUNS[i].1)), "run {} got a frame of another run", i);
                }
                prop_assert_eq!(seen.len(), want.events[i], "run {}: events delivered", i);
            }
            for (k, caller) in callers.iter().enumerate() {
                let got = caller.send(Replies).await.expect("caller");
                prop_assert!(got.iter().all(|(tag, _)| *tag == k as u64), "caller {} got another call's tag: {:?}", k, got);
                let got: Vec<Got> = got.into_iter().map(|(_, g)| g).collect();
                prop_assert_eq!(&got, &want.replies[k], "caller {} ({})", k, CALLS[k].0);
            }
            // Alive (it answers), reconnected after every shutdown, and holding only what it must.
            let stats = sup.send(Stats).await.expect("the supervisor survived the sequence");
            prop_assert_eq!((stats.pending, stats.routes, stats.abandoned), (want.pending, RUNS.len(), 0));
            prop_assert_eq!(gw.connections(), 1 + want.shutdowns);
            stop_system().await;
            Ok(())
        })?;
    }
}

/// A flood of frames that address nobody of this process (foreign sessions, foreign runs of our
/// sessions, near-misses, answers to requests never made, unknown events, garbage) adds nothing
/// the supervisor holds and reaches no run.
#[actix_rt::test]
async fn a_flood_of_misaddressed_frames_adds_nothing_the_supervisor_holds() {
    const FLOOD: usize = 20_000;
    let gw = Loopback::start().await;
    let (sup, status) = supervisor(&gw.url);
    until_connected(&status).await;
    let runs = route_probes(&sup);
    let caller = CallProbe::default().start();
    let mut call = Call::new("agent", json!({}), 7, Some(caller.clone().recipient()));
    call.wait = Wait::Caller;
    sup.do_send(call);
    gw.wait_requests(1).await;
    let before = sup.send(Stats).await.expect("stats");
    assert_eq!((before.pending, before.routes, before.abandoned), (1, RUNS.len(), 0));
    for n in 0..FLOOD {
        let (key, run) = RUNS[n % RUNS.len()];
        let frame = match n % 8 {
            0 => json!({"type": "event", "event": "chat", "payload": {"sessionKey": format!("agent:main:intruder-{n}"), "runId": run, "state": "delta", "message": {"content": "x"}}}),
            1 => json!({"type": "event", "event": "chat", "payload": {"sessionKey": key, "runId": format!("other-{n}"), "state": "final", "message": {"content": "x"}}}),
            2 => json!({"type": "event", "event": "agent", "payload": {"sessionKey": key.to_uppercase(), "runId": run, "stream": "lifecycle", "data": {"phase": "end"}}}),
            3 => json!({"type": "event", "event": "agent", "payload": {"stream": "assistant", "data": {"text": "x"}}}),
            4 => json!({"type": "res", "id": format!("cm-{}", 1000 + n), "ok": true, "payload": {"status": "accepted", "runId": run}}),
            5 => json!({"type": "event", "event": format!("unknown.{n}"), "payload": {"n": n}}),
            6 => json!({"type": "event", "event": "tick", "payload": {"ts": n}}),
            _ => Value::String(format!("garbage {n}")),
        };
        gw.send(frame.to_string());
    }
    sentinel(&gw, &runs[0]).await;
    let after = sup.send(Stats).await.expect("stats");
    assert_eq!(after, before, "the flood changed what the supervisor holds");
    for (i, probe) in runs.iter().enumerate() {
        let seen: Vec<_> = probe.send(SeenEvents).await.expect("probe").into_iter().filter(|e| e.text.as_deref() != Some(SENTINEL)).collect();
        assert!(seen.is_empty(), "run {i} got misaddressed frames: {:?}", &seen[..seen.len().min(3)]);
    }
    assert!(caller.send(Replies).await.expect("caller").is_empty());
    assert_eq!(gw.connections(), 1);
    stop_system().await;
}

/// An `agent` request has no deadline in the supervisor (its run owns it). When its caller is
/// gone (the run ended before the final `res` came, from a gateway that never sends it), the
/// request is forgotten: it must not be held for as long as the connection lives.
#[actix_rt::test]
async fn agent_requests_whose_caller_is_gone_are_forgotten() {
    const GONE: usize = 50;
    let gw = Loopback::start().await;
    let (sup, status) = supervisor(&gw.url);
    until_connected(&status).await;
    let mut callers = Vec::new();
    for k in 0..=GONE {
        let caller = CallProbe::default().start();
        let mut call = Call::new("agent", json!({}), k as u64, Some(caller.clone().recipient()));
        call.wait = Wait::Caller;
        sup.do_send(call);
        callers.push(caller);
    }
    gw.wait_requests(GONE + 1).await;
    assert_eq!(sup.send(Stats).await.expect("stats").pending, GONE + 1);
    let live = callers.pop().expect("the last caller stays");
    for c in &callers {
        c.do_send(Leave);
    }
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let pending = sup.send(Stats).await.expect("stats").pending;
        if pending == 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{pending} requests still pending {WAIT:?} after {GONE} of their callers left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The caller still there gets its answer.
    let live_id = gw.requests().last().map(|(_, id)| id.clone()).expect("requests");
    gw.send(json!({"type": "res", "id": live_id, "ok": true, "payload": {"runId": "g-1", "status": "ok"}}).to_string());
    let deadline = tokio::time::Instant::now() + WAIT;
    while live.send(Replies).await.expect("caller").is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the live caller got no answer");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(sup.send(Stats).await.expect("stats").pending, 0);
    stop_system().await;
}

/// Gateway runs given up on during an outage are remembered for cancelling, but at most
/// [`MAX_ABANDONED`] of them (the oldest are forgotten).
#[actix_rt::test]
async fn gateway_runs_remembered_during_an_outage_are_capped() {
    // A port nobody listens on: every connect is refused, so the runs stay remembered.
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let (sup, _status) = supervisor(&format!("ws://127.0.0.1:{port}"));
    for n in 0..MAX_ABANDONED + 500 {
        sup.do_send(Abandon { session_key: SessionKey::canonicalize(RUNS[n % 3].0), gateway_run_id: format!("g-{n}"), boot_id: None });
    }
    let stats = sup.send(Stats).await.expect("stats");
    assert_eq!(stats.abandoned, MAX_ABANDONED);
    stop_system().await;
}
