//! clawmux against the REAL protocol-4 gateway (openclaw@2026.9.6) reached over a network: the
//! gateway runs in a network namespace of the test's own, bound to its namespace address, and
//! clawmux connects from the host side over a veth pair (no loopback anywhere on the path).
//!
//! `tests/run.sh` creates the namespace (`tests/support/netns.sh up`), starts the gateway and the
//! fake LLM in it (`NETNS=… BIND_HOST=… tests/support/gateway.sh start`), runs this binary with
//! `CLAWMUX_NETNS_GATEWAY_ENV=<run dir>/env --test-threads=1`, then stops them by PID and removes
//! the namespace. Without that variable these tests say so and return, unless
//! `CLAWMUX_REQUIRE_NETNS=1`, in which case they fail.
//!
//! What they show (and print with `eprintln!`, so the exact gateway texts can be quoted):
//! - without a device identity the gateway still accepts the token but grants NO scopes to a
//!   non-loopback client, and clawmux's `/readyz` says it is not ready and why;
//! - with a device identity the gateway refuses `connect` until the device is paired; `/readyz`
//!   names the device id and the `openclaw devices approve` command; approving it with the
//!   gateway's own CLI (`tests/support/gateway.sh approve-device`) makes clawmux ready by itself
//!   (its reconnect backoff), and a run succeeds;
//! - a restarted clawmux with the same key file is the same device and needs no new approval.

mod common;

use clawmux::config::DeviceMode;
use clawmux_actors::device::{DeviceIdentity, SignParams};
use clawmux_protocol::handshake::ConnectParams;
use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;

/// The namespaced gateway, from `RUN_DIR/env`.
struct Gateway {
    url: String,
    token: String,
    run_dir: String,
    netns: String,
    bind_host: String,
}

fn gateway() -> Option<Gateway> {
    let Ok(path) = std::env::var("CLAWMUX_NETNS_GATEWAY_ENV") else {
        assert!(
            std::env::var("CLAWMUX_REQUIRE_NETNS").as_deref() != Ok("1"),
            "CLAWMUX_REQUIRE_NETNS=1 but CLAWMUX_NETNS_GATEWAY_ENV is not set: run tests/run.sh (as root)"
        );
        eprintln!("namespaced gateway not started (tests/run.sh does it as root); skipping");
        return None;
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
    let env: HashMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let get = |k: &str| env.get(k).unwrap_or_else(|| panic!("{path} lacks {k}")).to_string();
    let g = Gateway {
        url: get("GATEWAY_URL"),
        token: get("GATEWAY_TOKEN"),
        run_dir: get("RUN_DIR"),
        netns: get("NETNS"),
        bind_host: get("BIND_HOST"),
    };
    assert!(!g.netns.is_empty() && !g.bind_host.is_empty(), "{path}: the gateway was not started with NETNS and BIND_HOST");
    let host = g.bind_host.parse::<std::net::Ipv4Addr>().expect("BIND_HOST is an IPv4 address");
    assert!(!host.is_loopback(), "BIND_HOST {host} is loopback: this test is about a non-loopback gateway");
    assert!(g.url.starts_with(&format!("ws://{host}:")), "GATEWAY_URL {} does not use BIND_HOST {host}", g.url);
    eprintln!("namespaced gateway: {} (namespace {}, run dir {})", g.url, g.netns, g.run_dir);
    Some(g)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("client")
}

/// A fresh key file path (the file does not exist yet: clawmux creates it).
fn fresh_key_file(tag: &str) -> PathBuf {
    temp_dir(tag).join("device-key.json")
}

async fn start(g: &Gateway, mode: DeviceMode, key_file: &Path) -> clawmux::server::Running {
    let key_file = key_file.to_owned();
    start_clawmux(&g.url, Some(&g.token), move |cfg| {
        cfg.device_identity = mode;
        cfg.device_key_file = key_file;
    })
    .await
}

/// `/readyz` as (status, body).
async fn readyz(c: &reqwest::Client, base: &str) -> (u16, Value) {
    let r = c.get(format!("{base}/readyz")).send().await.expect("readyz");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Polls `/readyz` until `pred(status, body)` holds (bounded); returns the body.
async fn readyz_until(c: &reqwest::Client, base: &str, within: Duration, what: &str, pred: impl Fn(u16, &Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let (status, body) = readyz(c, base).await;
        if pred(status, &body) {
            return body;
        }
        assert!(tokio::time::Instant::now() < deadline, "/readyz never showed {what} within {within:?}; last: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Removes secrets a gateway answer may carry (hello-ok's device token) before printing it.
fn redact(mut v: Value) -> Value {
    fn walk(v: &mut Value) {
        match v {
            Value::Object(m) => {
                for (k, val) in m.iter_mut() {
                    if k.to_ascii_lowercase().contains("token") && val.is_string() {
                        *val = Value::String("<redacted>".to_owned());
                    } else {
                        walk(val);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// The parts of a `connect` answer worth printing: the whole frame for an error; for hello-ok only
/// `ok`, `protocol`, `server` and `auth` (the full hello-ok is ~100 KB of method lists).
fn summary(res: &Value) -> Value {
    if res["ok"] == true {
        let p = &res["payload"];
        redact(json!({"type": res["type"], "id": res["id"], "ok": true,
            "payload": {"type": p["type"], "protocol": p["protocol"], "server": p["server"], "auth": p["auth"]}}))
    } else {
        redact(res.clone())
    }
}

/// One raw `connect` to the gateway as clawmux sends it (same params; signed by `device` when
/// given), to record the gateway's exact answer. Optionally one more request after hello-ok.
/// Returns the `connect` answer and the answer to the extra request.
async fn raw_connect(g: &Gateway, device: Option<&DeviceIdentity>, then: Option<(&str, Value)>) -> (Value, Option<Value>) {
    let work = async {
        let (mut ws, _) = tokio_tungstenite::connect_async(g.url.as_str()).await.expect("WebSocket to the namespaced gateway");
        async fn next_json(ws: &mut (impl StreamExt<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin)) -> Value {
            loop {
                match ws.next().await {
                    Some(Ok(Message::Text(t))) => return serde_json::from_str(t.as_str()).expect("JSON frame"),
                    Some(Ok(Message::Close(f))) => panic!("the gateway closed the connection: {f:?}"),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => panic!("WebSocket error: {e}"),
                    None => panic!("the gateway ended the connection"),
                }
            }
        }
        let challenge = loop {
            let v = next_json(&mut ws).await;
            if v["type"] == "event" && v["event"] == "connect.challenge" {
                break v;
            }
        };
        let nonce = challenge["payload"]["nonce"].as_str().expect("challenge nonce").to_owned();
        let ts = challenge["payload"]["ts"].as_u64().unwrap_or(0);
        let mut params = ConnectParams::multiplexer(env!("CARGO_PKG_VERSION"), Some(g.token.clone()));
        if let Some(d) = device {
            let proof = d.prove(&SignParams {
                client_id: &params.client.id,
                client_mode: &params.client.mode,
                role: params.role.as_deref().unwrap_or("operator"),
                scopes: &params.scopes,
                signed_at_ms: ts,
                token: Some(&g.token),
                nonce: &nonce,
                platform: &params.client.platform,
                device_family: params.client.device_family.as_deref(),
            });
            params.device = Some(serde_json::to_value(proof).expect("proof"));
        }
        let req = clawmux_protocol::encode_request("connect", "connect", &params, None).expect("connect frame");
        ws.send(Message::text(req)).await.expect("send connect");
        let res = loop {
            let v = next_json(&mut ws).await;
            if v["type"] == "res" && v["id"] == "connect" {
                break v;
            }
        };
        let mut extra = None;
        if let (true, Some((method, p))) = (res["ok"] == true, then) {
            let req = clawmux_protocol::encode_request("probe", method, &p, None).expect("request frame");
            ws.send(Message::text(req)).await.expect("send request");
            extra = Some(loop {
                let v = next_json(&mut ws).await;
                if v["type"] == "res" && v["id"] == "probe" {
                    break v;
                }
            });
        }
        let _ = ws.close(None).await;
        (res, extra)
    };
    tokio::time::timeout(Duration::from_secs(30), work).await.expect("raw connect to the gateway timed out")
}

/// `tests/support/gateway.sh approve-device RUN_DIR ID` (off the runtime thread: the CLI takes
/// seconds). Returns (requestId, deviceId) it reports.
async fn approve_device(g: &Gateway, id: &str) -> (String, String) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/gateway.sh");
    let (run_dir, id) = (g.run_dir.clone(), id.to_owned());
    let t0 = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("bash")
            .args([script, "approve-device", &run_dir, &id])
            .env("APPROVE_WAIT", "20")
            .output()
            .expect("gateway.sh runs")
    })
    .await
    .expect("approve task");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!(
        "[approve] gateway.sh approve-device took {:.1} s; stdout: {}\n[approve] stderr:\n{}",
        t0.elapsed().as_secs_f64(),
        stdout.trim(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "approve-device failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("approved ")).expect("an `approved ...` line");
    let field = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).map(str::to_owned).expect(k);
    (field("requestId"), field("deviceId"))
}

/// The request id in "`openclaw devices approve <id>`" of a reason, if the reason names one.
fn approve_arg(reason: &str) -> Option<String> {
    let rest = reason.split_once("`openclaw devices approve ")?.1;
    let arg = rest.split_once('`')?.0;
    (arg != "<requestId>").then(|| arg.to_owned())
}

/// A run through clawmux; returns the terminal event.
async fn run_once(c: &reqwest::Client, base: &str, marker: &str) -> SseEvent {
    let body = json!({"message": format!("remote gateway check {marker}"), "billingAccountId": "acct-netns"});
    let resp = post_sse(c, base, &body, &[]).await;
    assert_eq!(resp.status(), 200, "POST /v1/runs");
    let mut sse = SseReader::new(resp);
    sse.terminal(Duration::from_secs(90)).await.expect("terminal event")
}

#[actix_rt::test]
async fn netns_without_a_device_identity_the_remote_gateway_grants_no_scopes() {
    let Some(g) = gateway() else { return };

    // What the gateway itself answers a non-loopback client without a device identity.
    let (res, probe) = raw_connect(&g, None, Some(("sessions.list", json!({})))).await;
    eprintln!("[no device] gateway answer to connect: {}", summary(&res));
    eprintln!("[no device] gateway answer to sessions.list: {}", probe.as_ref().map(|p| redact(p.clone())).unwrap_or(Value::Null));
    if res["ok"] == true {
        // openclaw 2026.9.6: the token is accepted, every scope is stripped.
        let scopes = res["payload"]["auth"]["scopes"].as_array().cloned().unwrap_or_default();
        assert!(
            !scopes.iter().any(|s| s == "operator.read" || s == "operator.write"),
            "a non-loopback client without a device identity was granted {scopes:?}"
        );
        let probe = probe.expect("sessions.list answer");
        assert_eq!(probe["ok"], false, "sessions.list without scopes: {probe}");
    } else {
        // A gateway that refuses outright must say it wants a device identity / pairing.
        let text = res["error"].to_string();
        assert!(text.contains("DEVICE_IDENTITY_REQUIRED") || text.contains("NOT_PAIRED") || text.contains("PAIRING_REQUIRED"), "{res}");
    }

    // What clawmux makes of it.
    let key = fresh_key_file("netns-off");
    let running = start(&g, DeviceMode::Off, &key).await;
    let base = base(&running);
    let c = client();
    let body = readyz_until(&c, &base, Duration::from_secs(30), "a reason", |st, b| st == 503 && b["reason"].as_str().is_some_and(|r| !r.contains("connecting to the gateway"))).await;
    let reason = body["reason"].as_str().unwrap_or_default().to_owned();
    eprintln!("[no device] clawmux /readyz: 503 {body}");
    assert!(
        reason.contains("device identity") || reason.contains("pair") || (reason.contains("granted scopes []") && reason.contains("operator.write")),
        "the reason must say what the gateway demands (a device identity / pairing, or no scopes granted): {reason}"
    );
    assert!(!reason.contains(&g.token), "the reason must not echo the token");
    assert!(!key.exists(), "CLAWMUX_DEVICE_IDENTITY=off must not create a key file");
    // A run cannot succeed without scopes. (clawmux admits runs on a connected-but-unready
    // gateway, so the gateway's refusal comes back as the run's error; either way it must fail.)
    let (status, doc) = post_json(&c, &base, &json!({"message": "hi", "billingAccountId": "acct-netns"})).await;
    eprintln!("[no device] POST /v1/runs: {status} {doc}");
    if status == 503 {
        assert_eq!(doc["error"]["code"], "gateway_unavailable", "{doc}");
    } else {
        assert_eq!(status, 200, "{doc}");
        assert_eq!(doc["status"], "error", "a run succeeded without scopes: {doc}");
        assert!(doc["error"]["message"].as_str().is_some_and(|m| m.contains("missing scope")), "{doc}");
    }
    clawmux::server::shutdown(&running).await;
    let _ = std::fs::remove_dir_all(key.parent().expect("key dir"));
}

#[actix_rt::test]
async fn netns_a_device_identity_is_paired_once_with_the_gateways_cli_then_reused() {
    let Some(g) = gateway() else { return };
    let key = fresh_key_file("netns-device");
    let c = client();

    // (b) a fresh device: clawmux creates the key and the gateway wants it paired.
    let t_start = Instant::now();
    let running = start(&g, DeviceMode::On, &key).await;
    let base1 = base(&running);
    let device_id = DeviceIdentity::load_or_create(&key).expect("clawmux created the key file").device_id().to_owned();
    eprintln!("[device] clawmux device id {device_id} (key file {})", key.display());

    // The gateway's exact answer to that device (same params and signature as clawmux's connect).
    let identity = DeviceIdentity::load_or_create(&key).expect("key");
    let (res, _) = raw_connect(&g, Some(&identity), None).await;
    eprintln!("[device] gateway answer to a signed connect of the unpaired device: {}", summary(&res));
    assert_eq!(res["ok"], false, "an unpaired device must not be let in over the network: {}", summary(&res));
    let err = &res["error"];
    let code = err["code"].as_str().unwrap_or_default();
    let detail = err["details"]["code"].as_str().unwrap_or_default();
    assert!(
        ["NOT_PAIRED", "PAIRING_REQUIRED"].contains(&code) || ["NOT_PAIRED", "PAIRING_REQUIRED"].contains(&detail),
        "the gateway refused with something other than pairing: {res}"
    );
    if let Some(d) = err["details"]["deviceId"].as_str() {
        assert_eq!(d, device_id, "the gateway names another device");
    }
    let gateway_request_id = err["details"]["requestId"].as_str().map(str::to_owned);

    let body = readyz_until(&c, &base1, Duration::from_secs(30), "the pairing reason", |st, b| {
        st == 503 && b["reason"].as_str().is_some_and(|r| r.contains("openclaw devices approve"))
    })
    .await;
    let reason = body["reason"].as_str().unwrap_or_default().to_owned();
    eprintln!("[device] clawmux /readyz before approval: 503 {body}");
    assert!(reason.contains(&device_id), "the reason must name the device id: {reason}");
    assert!(reason.contains("openclaw devices approve"), "{reason}");
    assert!(!reason.contains(&g.token), "the reason must not echo the token");
    assert!(running.state.status.read().expect("status").pairing_required, "status.pairing_required");
    // clawmux keeps retrying while it waits (backoff), and stays unready.
    let failed_before = metric(&c, &base1, "clawmux_gateway_connects_total{outcome=\"failed\"}").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let failed_after = metric(&c, &base1, "clawmux_gateway_connects_total{outcome=\"failed\"}").await;
    eprintln!("[device] failed connect attempts while unpaired: {failed_before} -> {failed_after} in 2 s");
    assert!(failed_after > failed_before, "clawmux stopped retrying while the device is unpaired");
    let (st, body) = readyz(&c, &base1).await;
    assert_eq!(st, 503, "{body}");

    // The operator runs the command the reason names. The gateway's CLI approves a pending REQUEST
    // id; when the reason names one, use exactly that; otherwise look the request up by device id.
    let named = approve_arg(&reason);
    eprintln!("[device] the reason names `openclaw devices approve {}`", named.as_deref().unwrap_or("<requestId>"));
    if let (Some(n), Some(r)) = (&named, &gateway_request_id) {
        assert_eq!(n, r, "the reason names another request than the gateway's details.requestId");
    }
    let t_approve = Instant::now();
    let (request_id, approved_device) = approve_device(&g, named.as_deref().unwrap_or(&device_id)).await;
    assert_eq!(approved_device, device_id, "approve-device approved another device");
    if let Some(n) = &named {
        assert_eq!(&request_id, n);
    }

    // clawmux becomes ready by itself (its reconnect backoff), without a restart.
    let t_approved = Instant::now();
    let body = readyz_until(&c, &base1, Duration::from_secs(30), "ready after the approval", |st, _| st == 200).await;
    eprintln!(
        "[device] clawmux ready {:.2} s after the approval returned (approval took {:.1} s; {:.1} s since clawmux started): {body}",
        t_approved.elapsed().as_secs_f64(),
        t_approved.duration_since(t_approve).as_secs_f64(),
        t_start.elapsed().as_secs_f64()
    );
    let scopes: Vec<String> = serde_json::from_value(body["scopes"].clone()).unwrap_or_default();
    assert!(scopes.iter().any(|s| s == "operator.write") && scopes.iter().any(|s| s == "operator.read"), "scopes after pairing: {body}");
    assert_eq!(body["protocol"], 4, "{body}");
    let (res, _) = raw_connect(&g, Some(&identity), None).await;
    eprintln!("[device] gateway answer to a signed connect of the paired device: {}", summary(&res));
    assert_eq!(res["ok"], true, "{}", summary(&res));

    let marker = format!("NETNS{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let t = run_once(&c, &base1, &marker).await;
    eprintln!("[device] run through the paired connection: {} {}", t.event, t.data);
    assert_eq!(t.event, "final", "{t:?}");
    assert!(t.data["content"].as_str().is_some_and(|s| s.contains(&marker)), "{t:?}");
    clawmux::server::shutdown(&running).await;

    // (c) a restarted clawmux with the same key file is the same, already approved device.
    let t_restart = Instant::now();
    let running = start(&g, DeviceMode::On, &key).await;
    let base2 = base(&running);
    let body = readyz_until(&c, &base2, Duration::from_secs(30), "ready after the restart", |st, b| {
        assert!(!b["reason"].as_str().is_some_and(|r| r.contains("openclaw devices approve")), "the restarted clawmux was asked for a new approval: {b}");
        st == 200
    })
    .await;
    eprintln!("[device] restarted clawmux ready in {:.2} s with no new approval: {body}", t_restart.elapsed().as_secs_f64());
    let id_after = running.state.status.read().expect("status").device_id.clone();
    assert_eq!(id_after.as_deref(), Some(device_id.as_str()), "the restart changed the device id");
    assert_eq!(DeviceIdentity::load_or_create(&key).expect("key").device_id(), device_id);
    let marker = format!("NETNSR{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let t = run_once(&c, &base2, &marker).await;
    assert_eq!(t.event, "final", "{t:?}");
    assert!(t.data["content"].as_str().is_some_and(|s| s.contains(&marker)), "{t:?}");
    clawmux::server::shutdown(&running).await;
    let _ = std::fs::remove_dir_all(key.parent().expect("key dir"));
}

#[test]
fn approve_arg_reads_the_command_of_a_reason() {
    assert_eq!(approve_arg("x `openclaw devices approve abc-1` y").as_deref(), Some("abc-1"));
    assert_eq!(approve_arg("x `openclaw devices approve <requestId>` y"), None);
    assert_eq!(approve_arg("no command"), None);
}
