//! Running a command inside the gateway container: the [`ContainerExec`] seam, its Docker
//! implementation ([`DockerExec`], bollard) and a recording wrapper ([`Recording`]).
//!
//! Rules every implementation keeps: the command is an argv (never a shell string built from
//! request data), stdout and stderr stay apart, the exit code is read from the engine after the
//! output is drained (reaching the end of the output says nothing about success), and every call
//! is bounded in time and in output size. No environment is passed: nothing secret can reach the
//! container through an exec.

use super::RelayError;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::Docker;
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a finished command left behind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// The process's exit code (as the engine reports it).
    pub exit_code: i64,
    /// Everything written to stdout.
    pub stdout: Vec<u8>,
    /// Everything written to stderr.
    pub stderr: Vec<u8>,
}

impl ExecOutput {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.exit_code == 0
    }
    /// stdout as text (lossy), trailing whitespace removed.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).trim_end().to_owned()
    }
    /// stderr as text (lossy), trimmed, at most 2000 characters (for error messages).
    pub fn stderr_text(&self) -> String {
        let s = String::from_utf8_lossy(&self.stderr);
        let s = s.trim();
        match s.char_indices().nth(2000) {
            Some((i, _)) => format!("{}…", &s[..i]),
            None => s.to_owned(),
        }
    }
}

/// Runs one command in the container the relay works in.
///
/// `argv[0]` is the program; nothing is interpreted by a shell. `workdir` is the working directory
/// inside the container (`None`: the container's default). The future resolves when the command has
/// exited (any exit code is `Ok`) or fails with [`RelayError::Timeout`] after `timeout`.
pub trait ContainerExec: Send + Sync {
    /// Runs `argv` and returns its exit code and output.
    fn exec<'a>(&'a self, argv: &'a [String], workdir: Option<&'a str>, timeout: Duration) -> BoxFuture<'a, Result<ExecOutput, RelayError>>;
}

impl<T: ContainerExec + ?Sized> ContainerExec for Arc<T> {
    fn exec<'a>(&'a self, argv: &'a [String], workdir: Option<&'a str>, timeout: Duration) -> BoxFuture<'a, Result<ExecOutput, RelayError>> {
        (**self).exec(argv, workdir, timeout)
    }
}

/// Default bound on one exec's stdout + stderr (a `format-patch` of many commits can be large).
pub const DEFAULT_MAX_OUTPUT: usize = 64 * 1024 * 1024;

/// [`ContainerExec`] through the Docker Engine API (bollard): create an exec (attached, no TTY,
/// so stdout and stderr arrive as separate frames), start it, drain both streams, then inspect the
/// exec for its exit code.
#[derive(Clone)]
pub struct DockerExec {
    /// The engine connection (unix socket or `tcp://`, version negotiated).
    docker: Docker,
    /// Container name or id.
    container: String,
    /// `user[:group]` to run as; `None` = the container's user (the gateway's uid, which must own
    /// the workspace: git refuses "dubious ownership" otherwise).
    user: Option<String>,
    /// Bound on stdout + stderr of one exec.
    max_output: usize,
    /// Prefix commands with `timeout -s KILL <secs>` so a hung command dies inside the container
    /// too (the engine API has no way to kill an exec).
    kill_in_container: bool,
}

impl std::fmt::Debug for DockerExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerExec").field("container", &self.container).field("user", &self.user).finish()
    }
}

impl DockerExec {
    /// Connects to the engine (`docker_host`, e.g. `unix:///var/run/docker.sock` or
    /// `tcp://127.0.0.1:2375`; `None`: `DOCKER_HOST` or the local socket), negotiates the API
    /// version, and checks that `container` exists and runs.
    pub async fn connect(docker_host: Option<&str>, container: &str, user: Option<&str>) -> Result<Self, RelayError> {
        let docker = match docker_host {
            Some(h) if !h.is_empty() => Docker::connect_with_host(h),
            _ => Docker::connect_with_defaults(),
        }
        .map_err(|e| RelayError::Docker(format!("cannot connect to the Docker engine: {e}")))?;
        let docker = docker.negotiate_version().await.map_err(|e| RelayError::Docker(format!("Docker engine does not answer: {e}")))?;
        let info = docker
            .inspect_container(container, None::<bollard::query_parameters::InspectContainerOptions>)
            .await
            .map_err(|e| RelayError::Docker(format!("container {container:?}: {e}")))?;
        let running = info.state.as_ref().and_then(|s| s.running).unwrap_or(false);
        if !running {
            return Err(RelayError::Docker(format!("container {container:?} is not running")));
        }
        Ok(Self { docker, container: container.to_owned(), user: user.map(str::to_owned), max_output: DEFAULT_MAX_OUTPUT, kill_in_container: true })
    }

    /// Sets the bound on one exec's output.
    pub fn with_max_output(mut self, bytes: usize) -> Self {
        self.max_output = bytes;
        self
    }

    /// Turns the in-container `timeout -s KILL` prefix off (for images without `timeout`).
    pub fn without_kill_in_container(mut self) -> Self {
        self.kill_in_container = false;
        self
    }

    /// The container this runs in.
    pub fn container(&self) -> &str {
        &self.container
    }

    async fn run(&self, argv: &[String], workdir: Option<&str>, timeout: Duration) -> Result<ExecOutput, RelayError> {
        let mut cmd: Vec<String> = Vec::with_capacity(argv.len() + 4);
        if self.kill_in_container {
            let secs = timeout.as_secs().max(1) + 1;
            cmd.extend(["timeout".to_owned(), "-s".to_owned(), "KILL".to_owned(), secs.to_string()]);
        }
        cmd.extend(argv.iter().cloned());
        let opts = CreateExecOptions::<String> {
            attach_stdin: Some(false),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            cmd: Some(cmd),
            env: None,
            user: self.user.clone(),
            working_dir: workdir.map(str::to_owned),
            privileged: Some(false),
            ..Default::default()
        };
        let created = self.docker.create_exec(&self.container, opts).await.map_err(|e| RelayError::Docker(format!("create exec in {:?}: {e}", self.container)))?;
        let started = self
            .docker
            .start_exec(&created.id, Some(StartExecOptions { detach: false, tty: false, output_capacity: Some(64 * 1024) }))
            .await
            .map_err(|e| RelayError::Docker(format!("start exec: {e}")))?;
        let mut out = ExecOutput::default();
        if let StartExecResults::Attached { mut output, input } = started {
            drop(input); // no stdin: the command sees EOF
            while let Some(frame) = output.next().await {
                let frame = frame.map_err(|e| RelayError::Docker(format!("exec output: {e}")))?;
                match frame {
                    bollard::container::LogOutput::StdErr { message } => out.stderr.extend_from_slice(&message),
                    bollard::container::LogOutput::StdOut { message } | bollard::container::LogOutput::Console { message } => out.stdout.extend_from_slice(&message),
                    bollard::container::LogOutput::StdIn { .. } => {}
                }
                if out.stdout.len() + out.stderr.len() > self.max_output {
                    return Err(RelayError::OutputTooLarge { limit: self.max_output });
                }
            }
        } else {
            return Err(RelayError::Docker("exec started detached".to_owned()));
        }
        // The stream ends when the process closes its output; the exit code may lag a moment.
        for _ in 0..200 {
            let ins = self.docker.inspect_exec(&created.id).await.map_err(|e| RelayError::Docker(format!("inspect exec: {e}")))?;
            if ins.running != Some(true) {
                if let Some(code) = ins.exit_code {
                    out.exit_code = code;
                    return Ok(out);
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(RelayError::Docker("exec finished its output but reports no exit code".to_owned()))
    }
}

impl ContainerExec for DockerExec {
    fn exec<'a>(&'a self, argv: &'a [String], workdir: Option<&'a str>, timeout: Duration) -> BoxFuture<'a, Result<ExecOutput, RelayError>> {
        Box::pin(async move {
            if argv.is_empty() {
                return Err(RelayError::Config("empty argv".to_owned()));
            }
            let t0 = std::time::Instant::now();
            match tokio::time::timeout(timeout + Duration::from_secs(2), self.run(argv, workdir, timeout)).await {
                Ok(r) => {
                    // `timeout -s KILL` reports 137 (128 + SIGKILL) when it had to kill
                    if let Ok(o) = &r {
                        if self.kill_in_container && o.exit_code == 137 && t0.elapsed() >= timeout {
                            return Err(RelayError::Timeout { what: describe(argv), after: timeout });
                        }
                    }
                    r
                }
                Err(_) => Err(RelayError::Timeout { what: describe(argv), after: timeout }),
            }
        })
    }
}

/// A short description of a command for messages: program and subcommand, never all arguments.
pub(crate) fn describe(argv: &[String]) -> String {
    // `git -C dir -c k=v … sub` → "git sub"
    let mut it = argv.iter();
    let prog = it.next().map(String::as_str).unwrap_or("?");
    let mut sub = None;
    while let Some(a) = it.next() {
        if a == "-C" || a == "-c" {
            it.next();
            continue;
        }
        if !a.starts_with('-') {
            sub = Some(a.as_str());
            break;
        }
    }
    match sub {
        Some(s) => format!("{prog} {s}"),
        None => prog.to_owned(),
    }
}

/// One exec as [`Recording`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedExec {
    /// The argv.
    pub argv: Vec<String>,
    /// The working directory.
    pub workdir: Option<String>,
    /// The exit code, when the exec finished.
    pub exit_code: Option<i64>,
}

/// A [`ContainerExec`] that records every argv it passes on (for audits and tests: no secret may
/// ever appear in one).
pub struct Recording<E> {
    /// The exec that does the work.
    inner: E,
    /// Everything run so far.
    log: Arc<Mutex<Vec<RecordedExec>>>,
}

impl<E> Recording<E> {
    /// Wraps `inner`.
    pub fn new(inner: E) -> Self {
        Self { inner, log: Arc::default() }
    }
    /// A handle on the record (shared with the wrapper).
    pub fn log(&self) -> Arc<Mutex<Vec<RecordedExec>>> {
        Arc::clone(&self.log)
    }
    /// A copy of everything recorded so far.
    pub fn calls(&self) -> Vec<RecordedExec> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl<E: ContainerExec> ContainerExec for Recording<E> {
    fn exec<'a>(&'a self, argv: &'a [String], workdir: Option<&'a str>, timeout: Duration) -> BoxFuture<'a, Result<ExecOutput, RelayError>> {
        Box::pin(async move {
            let r = self.inner.exec(argv, workdir, timeout).await;
            if let Ok(mut l) = self.log.lock() {
                l.push(RecordedExec { argv: argv.to_vec(), workdir: workdir.map(str::to_owned), exit_code: r.as_ref().ok().map(|o| o.exit_code) });
            }
            r
        })
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A scripted [`ContainerExec`] for unit tests: answers by matching the argv.
    use super::*;

    type Rule = (Box<dyn Fn(&[String]) -> bool + Send + Sync>, ExecOutput);

    /// Answers the first rule whose matcher accepts the argv; unmatched commands exit 127.
    #[derive(Default)]
    pub struct ScriptedExec {
        rules: Mutex<Vec<Rule>>,
        pub calls: Mutex<Vec<Vec<String>>>,
    }

    impl ScriptedExec {
        /// Adds a rule: argv containing all of `words` (in any position) answers `out`.
        pub fn on(&self, words: &[&str], code: i64, stdout: &str, stderr: &str) {
            let words: Vec<String> = words.iter().map(|w| (*w).to_owned()).collect();
            let m = move |argv: &[String]| words.iter().all(|w| argv.iter().any(|a| a == w));
            self.rules.lock().expect("lock").push((Box::new(m), ExecOutput { exit_code: code, stdout: stdout.as_bytes().to_vec(), stderr: stderr.as_bytes().to_vec() }));
        }
        pub fn calls(&self) -> Vec<Vec<String>> {
            self.calls.lock().expect("lock").clone()
        }
    }

    impl ContainerExec for ScriptedExec {
        fn exec<'a>(&'a self, argv: &'a [String], _workdir: Option<&'a str>, _timeout: Duration) -> BoxFuture<'a, Result<ExecOutput, RelayError>> {
            Box::pin(async move {
                self.calls.lock().expect("lock").push(argv.to_vec());
                let rules = self.rules.lock().expect("lock");
                for (m, out) in rules.iter() {
                    if m(argv) {
                        return Ok(out.clone());
                    }
                }
                Ok(ExecOutput { exit_code: 127, stdout: Vec::new(), stderr: b"no rule".to_vec() })
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn describe_names_program_and_subcommand_only() {
        assert_eq!(describe(&s(&["git", "-C", "/w", "-c", "core.hooksPath=/dev/null", "format-patch", "--stdout", "a..b"])), "git format-patch");
        assert_eq!(describe(&s(&["true"])), "true");
        assert_eq!(describe(&s(&[])), "?");
    }

    #[test]
    fn output_helpers() {
        let o = ExecOutput { exit_code: 0, stdout: b"abc\n\n".to_vec(), stderr: "x".repeat(3000).into_bytes() };
        assert!(o.success());
        assert_eq!(o.stdout_text(), "abc");
        assert_eq!(o.stderr_text().chars().count(), 2001);
    }

    #[tokio::test]
    async fn recording_keeps_argv_and_exit_code() {
        let f = fake::ScriptedExec::default();
        f.on(&["rev-parse"], 0, "abc\n", "");
        let r = Recording::new(f);
        let argv = s(&["git", "rev-parse", "HEAD"]);
        let out = r.exec(&argv, Some("/w"), Duration::from_secs(1)).await.expect("exec");
        assert_eq!(out.stdout_text(), "abc");
        let out = r.exec(&s(&["nope"]), None, Duration::from_secs(1)).await.expect("exec");
        assert_eq!(out.exit_code, 127);
        let calls = r.calls();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0], RecordedExec { argv, workdir: Some("/w".to_owned()), exit_code: Some(0) });
    }
}
