//! The gateway image's invariants (`../shared/seeds` "OpenClaw in Cogni": 13–17 and 25), checked
//! on an OpenClaw config as the gateway reads it, with the environment it runs with (`${VAR}` in
//! config strings is OpenClaw's env substitution). Pure: the tests feed it the config read from
//! inside the built image and the running container, and broken copies of it.

use serde_json::Value;
use std::collections::BTreeMap;

/// Every broken invariant of `config` run with `env`, one line each, naming the invariant.
pub fn violations(config: &Value, env: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut bad = |n: &str, what: String| out.push(format!("invariant {n}: {what}"));
    let at = |path: &[&str]| path.iter().try_fold(config, |v, k| v.get(*k));
    let agents: Vec<&Value> = config["agents"]["list"].as_array().map(|l| l.iter().collect()).unwrap_or_default();

    // 13 OPENCLAW_SANDBOX_OFF: the defaults and every listed agent
    if at(&["agents", "defaults", "sandbox", "mode"]).and_then(Value::as_str) != Some("off") {
        bad("13 (sandbox off)", format!("agents.defaults.sandbox.mode is {:?}, not \"off\"", at(&["agents", "defaults", "sandbox", "mode"])));
    }
    for a in &agents {
        if let Some(mode) = a["sandbox"]["mode"].as_str().filter(|m| *m != "off") {
            bad("13 (sandbox off)", format!("agent {} has sandbox.mode {mode:?}", a["id"]));
        }
    }
    // 14 OPENCLAW_CRON_DISABLED: explicitly false (the default is on)
    if config["cron"]["enabled"] != Value::Bool(false) {
        bad("14 (cron off)", format!("cron.enabled is {}, not false", config["cron"]["enabled"]));
    }
    // 15 OPENCLAW_ELEVATED_DISABLED
    if config["tools"]["elevated"]["enabled"] != Value::Bool(false) {
        bad("15 (elevated off)", format!("tools.elevated.enabled is {}, not false", config["tools"]["elevated"]["enabled"]));
    }
    for a in &agents {
        if a["tools"]["elevated"]["enabled"] == Value::Bool(true) {
            bad("15 (elevated off)", format!("agent {} enables elevated tools", a["id"]));
        }
    }
    // 16 COGNI_IS_MODEL_ROUTER: replace mode, ONE provider, pointing at clawmux's proxy (loopback:
    // the gateway shares clawmux's network namespace), every model reference through it
    if config["models"]["mode"] != "replace" {
        bad("16 (one provider, replace mode)", format!("models.mode is {}, not \"replace\"", config["models"]["mode"]));
    }
    let providers = config["models"]["providers"].as_object();
    match providers.map(|p| p.iter().collect::<Vec<_>>()).as_deref() {
        Some([(name, p)]) => {
            let raw = p["baseUrl"].as_str().unwrap_or_default();
            let url = substitute(raw, env);
            if !is_loopback_v1(&url) {
                bad("16 (one provider, replace mode)", format!("provider {name}'s baseUrl {raw:?} (= {url:?}) is not clawmux's proxy on loopback (http://127.0.0.1:PORT/v1)"));
            }
            let mut refs = vec![config["agents"]["defaults"]["model"]["primary"].clone()];
            refs.extend(agents.iter().map(|a| a["model"]["primary"].clone()).filter(|m| !m.is_null()));
            for r in refs {
                let ok = r.as_str().is_some_and(|m| m.strip_prefix(name.as_str()).is_some_and(|rest| rest.starts_with('/')));
                if !ok {
                    bad("16 (one provider, replace mode)", format!("model {r} is not one of provider {name}'s"));
                }
            }
        }
        other => bad("16 (one provider, replace mode)", format!("{} providers, not exactly one", other.map_or(0, <[_]>::len))),
    }
    // 17 NO_OPENCLAW_DASHBOARD: Control UI off, the gateway on loopback only
    if config["gateway"]["controlUi"]["enabled"] != Value::Bool(false) {
        bad("17 (no dashboard)", format!("gateway.controlUi.enabled is {}, not false", config["gateway"]["controlUi"]["enabled"]));
    }
    if config["gateway"]["bind"] != "loopback" {
        bad("17 (no dashboard)", format!("gateway.bind is {}, not \"loopback\"", config["gateway"]["bind"]));
    }
    // 25 HEARTBEAT_DISABLED: explicitly 0 (the default runs heartbeats)
    let off = |v: &Value| v.as_str().is_some_and(|s| matches!(s.trim(), "0" | "0m" | "0s" | "0h"));
    if !off(&config["agents"]["defaults"]["heartbeat"]["every"]) {
        bad("25 (heartbeats off)", format!("agents.defaults.heartbeat.every is {}, not \"0m\"", config["agents"]["defaults"]["heartbeat"]["every"]));
    }
    for a in &agents {
        if !a["heartbeat"]["every"].is_null() && !off(&a["heartbeat"]["every"]) {
            bad("25 (heartbeats off)", format!("agent {} runs heartbeats every {}", a["id"], a["heartbeat"]["every"]));
        }
    }
    // what makes the above hold in the image: no config write at run time, nothing included
    // from elsewhere, no plaintext gateway token baked in
    if env.get("OPENCLAW_CONFIG_READONLY").map(String::as_str) != Some("1") {
        bad("image (read-only config)", "OPENCLAW_CONFIG_READONLY is not 1: the gateway could rewrite its config".to_owned());
    }
    if let Some(path) = find_key(config, "$include", "") {
        bad("image (one config file)", format!("{path} pulls config from another file"));
    }
    if config["gateway"]["auth"]["token"].is_string() {
        bad("image (no secret)", "gateway.auth.token is a plaintext string in the config".to_owned());
    }
    out
}

/// OpenClaw's `${VAR}` substitution (upper-case names); an unset variable stays as written.
pub fn substitute(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find('}') {
            Some(end) if after[..end].chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') && !after[..end].is_empty() => {
                match env.get(&after[..end]) {
                    Some(v) => out.push_str(v),
                    None => out.push_str(&rest[start..start + 3 + end]),
                }
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str("${");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `http://127.0.0.1:PORT/v1` (or `localhost`, `[::1]`): clawmux's proxy seen from the gateway.
fn is_loopback_v1(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else { return false };
    let Some((host_port, path)) = rest.split_once('/') else { return false };
    let Some((host, port)) = host_port.rsplit_once(':') else { return false };
    matches!(host, "127.0.0.1" | "localhost" | "[::1]") && port.parse::<u16>().is_ok_and(|p| p > 0) && path.trim_end_matches('/') == "v1"
}

fn find_key(v: &Value, key: &str, path: &str) -> Option<String> {
    match v {
        Value::Object(m) => m.iter().find_map(|(k, c)| if k == key { Some(format!("{path}.{k}")) } else { find_key(c, key, &format!("{path}.{k}")) }),
        Value::Array(a) => a.iter().enumerate().find_map(|(i, c)| find_key(c, key, &format!("{path}[{i}]"))),
        _ => None,
    }
}
