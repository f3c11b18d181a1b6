//! The per-frame hot path of clawmux, on chat frames recorded from the real gateway:
//! decode the frame, route it to its run among 1,000 or 10,000 registered runs, turn the cumulative
//! text into an increment, and serialize the SSE event as the run store does (`{"text":…}` plus the
//! `id:`/`event:`/`data:` lines). Target (issue 12): at least 1,000,000 chat frames per second on one
//! core with 10,000 registered runs. The 1,000-run case is kept to compare with earlier figures.
//!
//! `cargo bench --bench hot_path` (criterion prints `thrpt` in frames/s: one element = one frame).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clawmux::replay::{Cassette, StepKind};
use clawmux_actors::delta::DeltaTracker;
use clawmux_actors::routes::RouteTable;
use clawmux_protocol::frame::{decode_frame, encode_event, Frame};
use clawmux_protocol::GatewayEvent;
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use std::fmt::Write as _;
use std::time::Duration;

const MAX_PAYLOAD: usize = 26_214_400;
/// Registered runs: the earlier figure, and the issue's.
const REGISTERED_RUNS: [usize; 2] = [1_000, 10_000];

/// The recorded chat delta frames of one run, as the gateway sent them (top-level `seq` added).
fn recorded_frames(track: &str) -> (String, String, Vec<String>) {
    let cassette = Cassette::parse(include_str!("../tests/cassettes/openclaw-2026.9.6.jsonl")).expect("bundled cassette");
    let t = cassette.tracks.iter().find(|t| t.name == track).expect("track");
    let frames: Vec<String> = t
        .steps
        .iter()
        .filter_map(|s| match &s.kind {
            StepKind::Event { name, payload } if name == "chat" && payload["state"] == "delta" => Some((name, payload)),
            _ => None,
        })
        .enumerate()
        .map(|(i, (name, payload))| encode_event(name, payload, Some(100 + i as u64)).expect("encodes"))
        .collect();
    (t.session_key.clone(), t.run_id.clone(), frames)
}

/// `runs - 1` other runs plus the recorded one, as a busy clawmux has them.
fn route_table(session_key: &str, run_id: &str, runs: usize) -> RouteTable<usize> {
    let mut table = RouteTable::new();
    for i in 0..runs - 1 {
        table.insert(&format!("agent:main:acct-{}:{}", i % 97, uuid::Uuid::new_v4()), &uuid::Uuid::new_v4().to_string(), i);
    }
    table.insert(session_key, run_id, runs - 1);
    table
}

/// One frame through the whole hot path; appends the SSE bytes to `out`. Returns the run index.
fn hot_path(frame: &str, table: &RouteTable<usize>, tracker: &mut DeltaTracker, event_id: &mut u64, out: &mut String) -> usize {
    let Ok(Frame::Event(ev)) = decode_frame(frame, MAX_PAYLOAD) else { panic!("not an event") };
    let (sk, rid) = ev.event.route_key().expect("run-scoped");
    let run = *table.route(sk, rid).expect("routed");
    if let GatewayEvent::Chat(chat) = ev.event {
        if let Some(delta) = chat.text().and_then(|t| tracker.push(t)) {
            // As `RunLog::text_delta` does.
            let data = clawmux::store::event_data::text_delta(&delta);
            *event_id += 1;
            let _ = write!(out, "id: {event_id}\nevent: text_delta\ndata: {data}\n\n");
        }
    }
    run
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_path");
    for track in ["short", "cold"] {
        let (session_key, run_id, frames) = recorded_frames(track);
        group.throughput(Throughput::Elements(frames.len() as u64));
        for runs in REGISTERED_RUNS {
            let table = route_table(&session_key, &run_id, runs);
            // The 1,000-run case keeps its earlier name (criterion baselines compare by name).
            let name = match runs {
                1_000 => format!("chat_frames_{track}_decode_route_delta_sse"),
                n => format!("chat_frames_{track}_decode_route{}k_delta_sse", n / 1000),
            };
            // One iteration = one run's recorded delta frames, in order, with a fresh tracker.
            group.bench_function(name, |b| {
                let mut out = String::with_capacity(4096);
                b.iter(|| {
                    out.clear();
                    let mut tracker = DeltaTracker::new();
                    let mut id = 0;
                    for f in &frames {
                        black_box(hot_path(black_box(f), &table, &mut tracker, &mut id, &mut out));
                    }
                    black_box(out.len())
                });
            });
        }
        group.bench_function(format!("chat_frames_{track}_decode_only"), |b| {
            b.iter(|| {
                for f in &frames {
                    black_box(decode_frame(black_box(f), MAX_PAYLOAD).is_ok());
                }
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4)).sample_size(50);
    targets = bench
}
criterion_main!(benches);
