//! How an ephemeral run ends, from how its container ended (pure): the same outcomes, error codes
//! and events as a gateway run's.

use super::envelope;
use super::runner::{Exit, RunnerError};
use clawmux_actors::{ErrorCode, RunOutcome};

/// Longest piece of the agent's stderr quoted in a run's error.
const MAX_QUOTED: usize = 600;

fn quoted(stderr: &str) -> String {
    let t = stderr.trim();
    if t.is_empty() {
        return String::new();
    }
    let start = t.char_indices().rev().nth(MAX_QUOTED - 1).map_or(0, |(i, _)| i);
    format!(": {}", &t[start..])
}

/// The run's outcome and the text to stream (`text_delta`) before it.
pub fn of(exit: Result<Exit, RunnerError>, output_limit: usize, memory_mb: i64) -> (RunOutcome, Option<String>) {
    let exit = match exit {
        Ok(e) => e,
        Err(e) => return (RunOutcome::failed(ErrorCode::Internal, format!("the run's container could not run: {e}"), String::new()), None),
    };
    let fail = |m: String| (RunOutcome::failed(ErrorCode::AgentError, m, String::new()), None);
    if exit.stdout_over_limit {
        return fail(format!("the agent's output exceeded {output_limit} bytes (the variant's output_bytes); the container was stopped"));
    }
    if exit.oom_killed {
        return fail(format!("the agent ran out of memory (limit {memory_mb} MB) and was killed"));
    }
    if exit.code != 0 {
        let why = if exit.code == 137 { " (killed)" } else { "" };
        return fail(format!("the agent exited with code {}{why}{}", exit.code, quoted(&exit.stderr_tail)));
    }
    match envelope::parse(&exit.stdout) {
        Err(reason) => fail(format!("{reason}{}", quoted(&exit.stderr_tail))),
        Ok(env) => match env.error {
            Some(e) => (RunOutcome::failed(ErrorCode::AgentError, format!("the agent failed: {e}"), env.text), None),
            None => {
                let delta = (!env.text.is_empty()).then(|| env.text.clone());
                (RunOutcome::ok(env.text, env.usage), delta)
            }
        },
    }
}

/// The outcome of a container that ended after the agent's own time limit (`limit_sec`, given to
/// it as `--timeout`): a failure then is the limit's doing, so the run ended `timeout`, with what
/// the agent said kept in the message; an agent that still finished ok is ok.
pub fn past_its_limit((outcome, text): (RunOutcome, Option<String>), limit_sec: u64) -> (RunOutcome, Option<String>) {
    let message = match (&outcome.error, outcome.status) {
        (Some(e), status) if status != clawmux_actors::RunStatus::Ok => {
            format!("the run exceeded its timeout: the agent stopped at the time limit it was given ({limit_sec} s); {}", e.message)
        }
        _ => return (outcome, text),
    };
    (RunOutcome::failed(ErrorCode::Timeout, message, outcome.content), text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clawmux_actors::RunStatus;

    fn exit(code: i64, stdout: &str) -> Exit {
        Exit { code, stdout: stdout.as_bytes().to_vec(), ..Exit::default() }
    }

    #[test]
    fn an_agent_that_failed_past_its_own_time_limit_timed_out() {
        let failed = of(Ok(Exit { code: 1, stderr_tail: "embedded run timeout: timeoutMs=80947".into(), ..Exit::default() }), 100, 1024);
        let (o, _) = past_its_limit(failed, 81);
        assert_eq!((o.status, o.error.as_ref().map(|e| e.code)), (RunStatus::Timeout, Some(ErrorCode::Timeout)));
        let message = o.error.expect("error").message;
        assert!(message.contains("time limit it was given (81 s)") && message.contains("embedded run timeout"), "{message}");
        let ok = of(Ok(exit(0, r#"{"payloads":[{"text":"hi"}],"meta":{}}"#)), 100, 1024);
        assert_eq!(past_its_limit(ok, 81).0, RunOutcome::ok("hi".into(), None), "an agent that finished ok is ok");
    }

    #[test]
    fn a_good_envelope_is_a_final_with_its_text() {
        let (o, delta) = of(Ok(exit(0, r#"{"payloads":[{"text":"hi"}],"meta":{"agentMeta":{"usage":{"input":3,"output":1}}}}"#)), 100, 1024);
        assert_eq!(o, RunOutcome::ok("hi".into(), Some((3, 1))));
        assert_eq!(delta.as_deref(), Some("hi"));
    }

    #[test]
    fn failures_are_agent_errors_with_the_reason() {
        let cases = [
            (Ok(exit(0, "not json")), "no JSON envelope"),
            (Ok(Exit { code: 1, stderr_tail: "Error: unknown option '--bogus'".into(), ..Exit::default() }), "code 1: Error: unknown option"),
            (Ok(exit(137, "")), "(killed)"),
            (Ok(Exit { code: 137, oom_killed: true, ..Exit::default() }), "out of memory (limit 1024 MB)"),
            (Ok(Exit { stdout_over_limit: true, ..Exit::default() }), "exceeded 100 bytes"),
            (Ok(exit(0, r#"{"payloads":[],"meta":{"error":{"kind":"context_overflow","message":"x"}}}"#)), "the agent failed: context_overflow"),
        ];
        for (e, want) in cases {
            let (o, delta) = of(e, 100, 1024);
            assert_eq!(o.status, RunStatus::Error);
            let err = o.error.expect("error");
            assert_eq!(err.code, ErrorCode::AgentError);
            assert!(err.message.contains(want), "{want}: {}", err.message);
            assert!(delta.is_none());
        }
        let (o, _) = of(Err(RunnerError::MissingImage("img:1".into())), 100, 1024);
        let err = o.error.expect("error");
        assert_eq!(err.code, ErrorCode::Internal);
        assert!(err.message.contains("img:1"), "{}", err.message);
    }

    #[test]
    fn long_stderr_is_quoted_by_its_end() {
        let long = format!("{}THE END", "x".repeat(5000));
        let (o, _) = of(Ok(Exit { code: 2, stderr_tail: long, ..Exit::default() }), 100, 1024);
        let m = o.error.expect("error").message;
        assert!(m.ends_with("THE END") && m.len() < 700, "{m}");
    }
}
