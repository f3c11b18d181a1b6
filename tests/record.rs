//! `clawmux record` round trip: record runs from a replay gateway (fast and deterministic), check
//! that no secret reached the file, parse it with `Cassette::parse`, replay it through another
//! replay gateway and get the recorded final text back.

#![allow(clippy::unwrap_used)]

use clawmux::load::ws::GatewayConn;
use clawmux::record::{record, RecordConfig};
use clawmux::replay::cassette::echo_prefix;
use clawmux::replay::{Cassette, ReplayConfig, ReplayGateway, StepKind};
use clawmux_protocol::frame::Frame;
use clawmux_protocol::methods::{decode_agent_reply, AgentParams, AgentReply};
use clawmux_protocol::ConnectParams;
use serde_json::Value;
use std::time::Duration;
use tokio::time::Instant;

const TOKEN: &str = "record-test-token-5f2e9a";

fn final_text(t: &clawmux::replay::Track) -> String {
    t.steps
        .iter()
        .find_map(|s| match &s.kind {
            StepKind::Final { payload } => payload.pointer("/result/payloads/0/text").and_then(Value::as_str).map(str::to_owned),
            StepKind::Event { .. } => None,
        })
        .unwrap()
}

/// Runs one `agent` on `url` and returns its final content.
async fn replay_once(url: &str, message: &str) -> String {
    let mut conn = GatewayConn::open(url, &ConnectParams::multiplexer("test", None)).await.unwrap();
    let params = AgentParams {
        message: message.to_owned(),
        agent_id: "main".into(),
        session_key: format!("agent:main:test:{}", uuid::Uuid::new_v4()),
        idempotency_key: uuid::Uuid::new_v4().to_string(),
        timeout: None,
        extra_system_prompt: None,
        label: None,
    };
    let id = conn.send("agent", &params).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = conn.next_until(deadline, "final").await.unwrap();
        if let Ok(Frame::Res(res)) = r.frame {
            if res.id == id {
                if let Ok(AgentReply::Final(f)) = decode_agent_reply(res.payload.unwrap().get()) {
                    return f.content();
                }
            }
        }
    }
}

#[tokio::test]
async fn recorded_cassette_round_trips_through_the_replay_gateway() {
    let source = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(4.0).token(TOKEN)).unwrap();
    let mut rc = RecordConfig::new(source.url(), vec!["first message [track:short]".into(), "second one [track:cold]".into()]);
    rc.token = Some(TOKEN.into());
    rc.names = vec!["short".into(), "cold".into()];
    rc.model = Some("cogni/fake-model-b".into());
    rc.linger = Duration::from_millis(300);
    let rec = record(&rc).await.unwrap();

    // No secret in the file: not the token, not a nonce (the key or any challenge value).
    let path = std::env::temp_dir().join(format!("clawmux-record-{}.jsonl", uuid::Uuid::new_v4()));
    rec.write(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(!text.contains(TOKEN), "the token was written");
    assert!(!text.to_ascii_lowercase().contains("nonce"), "a nonce was written");
    assert!(!text.contains("\"auth\""), "connect params were written");

    // It parses, and is what the recorder returned.
    let parsed = Cassette::parse(&text).unwrap();
    assert_eq!(parsed, rec.cassette);
    assert_eq!(parsed.protocol, 4);
    assert_eq!(parsed.tracks.len(), 2);
    for (t, msg) in parsed.tracks.iter().zip(&rc.messages) {
        assert_eq!(&t.message, msg);
        assert_eq!(t.model, "cogni/fake-model-b");
        assert!(t.session_id.is_some());
        let chats = t.steps.iter().filter(|s| matches!(&s.kind, StepKind::Event { name, .. } if name == "chat")).count();
        assert!(chats >= 2, "track {} has {chats} chat events", t.name);
        // The final text is the source's: the recorded message echoed before the recorded answer.
        assert!(final_text(t).starts_with(&echo_prefix(msg)), "{}", final_text(t));
        assert!(t.steps.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
        assert!(t.steps.first().unwrap().t_ms >= t.ack_t_ms);
    }
    // Recorded timing, at speed 4: the cold track's first event is ~3.3 s / 4 after the request.
    let cold_first = parsed.tracks[1].steps[0].t_ms;
    assert!((600..3000).contains(&cold_first), "cold first event at {cold_first} ms");

    // Replayed, the recording gives the recorded final text back (behind the new caller's echo).
    let replay = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::new(parsed.clone()).speed(0.0)).unwrap();
    for t in &parsed.tracks {
        let message = format!("again [track:{}]", t.name);
        let content = replay_once(&replay.url(), &message).await;
        assert_eq!(content, format!("{}{}", echo_prefix(&message), final_text(t)));
    }
    replay.stop().await;
    source.stop().await;
}

#[tokio::test]
async fn a_wrong_token_is_an_error_and_writes_nothing() {
    let source = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::default().speed(0.0).token(TOKEN)).unwrap();
    let mut rc = RecordConfig::new(source.url(), vec!["hi".into()]);
    rc.token = Some("wrong".into());
    let err = record(&rc).await.unwrap_err();
    assert!(err.to_string().contains("token mismatch"), "{err}");
    source.stop().await;
}

/// The cassettes recorded from the real gateway with `clawmux record` parse, and replay to their
/// recorded final text.
#[tokio::test]
async fn shipped_recordings_parse_and_replay() {
    for name in ["short", "long", "tool"] {
        let path = format!("{}/tests/cassettes/openclaw-2026.9.6-{name}.jsonl", env!("CARGO_MANIFEST_DIR"));
        let c = Cassette::from_path(&path).unwrap();
        assert_eq!((c.source.as_str(), c.protocol, c.tracks.len()), ("openclaw@2026.9.6", 4, 1), "{path}");
        let t = &c.tracks[0];
        assert_eq!(t.name, name);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.to_ascii_lowercase().contains("nonce"), "{path}");
        let gw = ReplayGateway::start("127.0.0.1:0".parse().unwrap(), ReplayConfig::new(c.clone()).speed(0.0)).unwrap();
        let content = replay_once(&gw.url(), "replayed").await;
        assert_eq!(content, format!("{}{}", echo_prefix("replayed"), final_text(t)), "{path}");
        gw.stop().await;
    }
}
