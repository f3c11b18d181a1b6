//! Host-side git: the relay's own clone of the remote, where the container's patches are applied
//! with `git am` and pushed.
//!
//! The environment: a host git child gets only what it needs, built here, never clawmux's own
//! environment (which holds `CLAWMUX_API_TOKEN`, `CLAWMUX_GATEWAY_TOKEN`, the LLM key, … that any
//! hook, helper or config-driven command git runs could read). [`child_env`]: `PATH`, `HOME` (an
//! empty directory of the relay's own, so no `~/.gitconfig`, `~/.git-credentials` or
//! `~/.netrc` is read), `LC_ALL=C`, `GIT_TERMINAL_PROMPT=0`, no system or global config
//! (`GIT_CONFIG_NOSYSTEM=1`, `GIT_CONFIG_GLOBAL=/dev/null`, `GIT_ATTR_NOSYSTEM=1`), the token
//! variable for an `http(s)` remote, and the few variables of this process a remote of that kind
//! needs to be reached ([`PASS_HTTP`]: proxies and CA bundles; [`PASS_SSH`]: the ssh agent and
//! ssh command).
//!
//! The token path: for an `http(s)` remote the token is put in the child's environment
//! (`CLAWMUX_RELAY_GIT_TOKEN`, this process's children only) and read by a credential helper given
//! as `-c credential.helper=!…`, whose text names the variable, never the value. Before it,
//! `-c credential.helper=` empties the helper list, so no configured helper is asked or told about
//! the token, and git never prompts (no terminal, no askpass). So the token is in no argv, no URL,
//! no file, and no process other than git's own helpers sees it. Local and ssh remotes get no token.

use super::git::HARDENING;
use super::RelayError;
use crate::config::Secret;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tracing::warn;

/// Name of the environment variable the credential helper reads (set on git children only).
pub const TOKEN_ENV: &str = "CLAWMUX_RELAY_GIT_TOKEN";

/// The credential helper: answers `get` with the token from [`TOKEN_ENV`]; ignores `store`/`erase`.
pub const CREDENTIAL_HELPER: &str = "!f() { test \"$1\" = get || exit 0; printf 'username=x-access-token\\npassword=%s\\n' \"$CLAWMUX_RELAY_GIT_TOKEN\"; }; f";

/// Variables of this process an `http(s)` remote may need: proxies and CA bundles.
pub const PASS_HTTP: &[&str] = &[
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
    "GIT_SSL_CAINFO",
    "GIT_SSL_CAPATH",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
];

/// Variables of this process an ssh remote may need: the agent and an ssh command of the
/// operator's (ssh itself finds `~/.ssh` through the user database, not `HOME`).
pub const PASS_SSH: &[&str] = &["SSH_AUTH_SOCK", "GIT_SSH_COMMAND", "GIT_SSH"];

/// Which kind of remote, for what its git children may be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    /// `http://` or `https://`: the token, proxies, CA bundles.
    Http,
    /// `ssh://` or `user@host:path`: the ssh agent.
    Ssh,
    /// A path or `file://`: nothing more.
    Local,
}

impl RemoteKind {
    /// The kind of `url`.
    pub fn of(url: &str) -> Self {
        if url.starts_with("https://") || url.starts_with("http://") {
            Self::Http
        } else if url.starts_with("ssh://") || url.starts_with("git+ssh://") || url.starts_with("ssh+git://") {
            Self::Ssh
        } else if url.contains("://") || url.starts_with('/') || url.starts_with('.') {
            Self::Local
        } else {
            // scp-like `host:path` (git's own rule: a colon before any slash)
            match (url.find(':'), url.find('/')) {
                (Some(c), Some(s)) if c < s => Self::Ssh,
                (Some(_), None) => Self::Ssh,
                _ => Self::Local,
            }
        }
    }
}

/// The whole environment of a host git child: nothing of this process's but `PATH` and, by
/// remote kind, [`PASS_HTTP`] or [`PASS_SSH`] (read through `parent`).
pub fn child_env(kind: RemoteKind, home: &Path, token: Option<&Secret>, parent: impl Fn(&str) -> Option<OsString>) -> Vec<(String, OsString)> {
    let mut env: Vec<(String, OsString)> = Vec::new();
    let pass: &[&str] = match kind {
        RemoteKind::Http => PASS_HTTP,
        RemoteKind::Ssh => PASS_SSH,
        RemoteKind::Local => &[],
    };
    for k in std::iter::once(&"PATH").chain(pass) {
        if let Some(v) = parent(k) {
            env.push(((*k).to_owned(), v));
        }
    }
    for (k, v) in [("HOME", home.as_os_str()), ("LC_ALL", "C".as_ref()), ("GIT_TERMINAL_PROMPT", "0".as_ref()), ("GIT_CONFIG_NOSYSTEM", "1".as_ref()), ("GIT_CONFIG_GLOBAL", "/dev/null".as_ref()), ("GIT_ATTR_NOSYSTEM", "1".as_ref())] {
        env.push((k.to_owned(), v.to_owned()));
    }
    if let (RemoteKind::Http, Some(t)) = (kind, token) {
        env.push((TOKEN_ENV.to_owned(), t.expose().into()));
    }
    env
}

/// How host git runs: the same for every command of one publish.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// The git binary (`git`: found on `PATH`).
    pub program: PathBuf,
    /// Bound on one command.
    pub timeout: Duration,
    /// Bound on each of one command's stdout and stderr: what a command prints is read into
    /// memory, in the process that serves every tenant, and the remote's history or the
    /// container's patches decide how much that is.
    pub max_output: usize,
    /// Committer identity for `git am` (the author stays the agent's).
    pub committer: (String, String),
    /// `HOME` of the children: an empty directory of the relay's own.
    pub home: PathBuf,
}

/// The output of one host git command.
#[derive(Debug)]
pub struct HostOutput {
    /// Exit code (-1 when killed by a signal).
    pub code: i32,
    /// stdout.
    pub stdout: Vec<u8>,
    /// stderr, as text, the token (if any) redacted.
    pub stderr: String,
}

impl HostOutput {
    /// stdout as trimmed text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).trim_end().to_owned()
    }
}

/// Runs git on the host in one directory.
pub struct HostGit {
    /// `-C` directory.
    dir: PathBuf,
    /// What the remote is: decides what of this process's environment its children get.
    kind: RemoteKind,
    /// The token for an `http(s)` remote; `None` otherwise.
    token: Option<Secret>,
    /// Program, bound, identity, `HOME`.
    settings: HostSettings,
}

impl HostGit {
    /// A runner in `dir`. `token` is only used when `remote_url` is `http(s)`.
    pub fn new(dir: &Path, remote_url: &str, token: Option<&Secret>, settings: HostSettings) -> Self {
        let kind = RemoteKind::of(remote_url);
        Self { dir: dir.to_owned(), kind, token: if kind == RemoteKind::Http { token.cloned() } else { None }, settings }
    }

    /// The same settings in another directory.
    pub fn in_dir(&self, dir: &Path) -> Self {
        Self { dir: dir.to_owned(), kind: self.kind, token: self.token.clone(), settings: self.settings.clone() }
    }

    /// Replaces the token in `s` (defence in depth: git does not print it).
    pub fn redact(&self, s: &str) -> String {
        match &self.token {
            Some(t) if !t.expose().is_empty() => s.replace(t.expose(), "<redacted>"),
            _ => s.to_owned(),
        }
    }

    /// The argv (without the program) for `args`: credential and identity settings, `-C`, hardening.
    pub fn argv(&self, args: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        // empty the helper list first: no configured helper sees (or stores) the token
        v.extend(["-c".into(), "credential.helper=".into()]);
        if self.token.is_some() {
            v.extend(["-c".into(), format!("credential.helper={CREDENTIAL_HELPER}")]);
        }
        v.extend(["-c".into(), format!("user.name={}", self.settings.committer.0), "-c".into(), format!("user.email={}", self.settings.committer.1)]);
        v.extend(["-C".into(), self.dir.to_string_lossy().into_owned()]);
        for h in HARDENING {
            v.extend(["-c".into(), (*h).to_owned()]);
        }
        v.extend(args.iter().map(|a| (*a).to_owned()));
        v
    }

    /// Runs `git <args>` with `stdin` (if any); any exit code is `Ok`.
    pub async fn run(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<HostOutput, RelayError> {
        let mut cmd = tokio::process::Command::new(&self.settings.program);
        cmd.args(self.argv(args)).env_clear().envs(child_env(self.kind, &self.settings.home, self.token.as_ref(), |k| std::env::var_os(k)));
        cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        let what = describe(args);
        let mut child = cmd.spawn().map_err(|e| RelayError::Io(format!("cannot run git on the host: {e}")))?;
        let feeder = match (stdin, child.stdin.take()) {
            (Some(data), Some(mut pipe)) => {
                let data = data.to_vec();
                Some(tokio::spawn(async move {
                    // a command that exits early closes the pipe: its exit code tells what happened
                    let _ = pipe.write_all(&data).await;
                    let _ = pipe.shutdown().await;
                }))
            }
            _ => None,
        };
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let max = self.settings.max_output;
        let collected = tokio::time::timeout(self.settings.timeout, async {
            let (out, err) = tokio::try_join!(read_capped(stdout, max, &what), read_capped(stderr, max, &what))?;
            let status = child.wait().await.map_err(|e| RelayError::Io(format!("{what}: {e}")))?;
            Ok::<_, RelayError>((status, out, err))
        })
        .await;
        let failed = match collected {
            Ok(Ok((status, stdout, stderr))) => {
                if let Some(f) = feeder {
                    let _ = f.await;
                }
                let stderr = self.redact(String::from_utf8_lossy(&stderr).trim());
                return Ok(HostOutput { code: status.code().unwrap_or(-1), stdout, stderr });
            }
            Ok(Err(e)) => e,
            Err(_) => RelayError::Timeout { what: what.clone(), after: self.settings.timeout },
        };
        // the child is stopped now, not whenever the runtime gets to a dropped handle
        let _ = child.kill().await;
        if let Some(f) = feeder {
            f.abort();
        }
        if let RelayError::OutputTooLarge { limit } = failed {
            warn!(what = %what, limit, "relay: host git printed more than the bound; killed");
        }
        Err(failed)
    }

    /// Like [`run`](Self::run), but a non-zero exit is an error naming the command.
    pub async fn ok(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<HostOutput, RelayError> {
        let o = self.run(args, stdin).await?;
        if o.code != 0 {
            return Err(RelayError::CommandFailed { what: describe(args), exit_code: i64::from(o.code), stderr: truncate(&o.stderr, 2000) });
        }
        Ok(o)
    }
}

/// All of `pipe` (none: empty), or [`RelayError::OutputTooLarge`] as soon as it passes `limit`
/// bytes: what is read is never more than `limit + 1`.
async fn read_capped(pipe: Option<impl AsyncRead + Unpin>, limit: usize, what: &str) -> Result<Vec<u8>, RelayError> {
    let mut buf = Vec::new();
    if let Some(p) = pipe {
        p.take(limit as u64 + 1).read_to_end(&mut buf).await.map_err(|e| RelayError::Io(format!("{what}: {e}")))?;
    }
    if buf.len() > limit {
        return Err(RelayError::OutputTooLarge { limit });
    }
    Ok(buf)
}

/// "git <subcommand>".
fn describe(args: &[&str]) -> String {
    format!("host git {}", args.first().copied().unwrap_or(""))
}

/// At most `n` characters.
pub fn truncate(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// Test helpers: the real git, and scripts standing in for it.
#[cfg(test)]
pub(super) mod scripts {
    use std::path::{Path, PathBuf};

    /// The real git on `PATH`.
    pub fn real_git() -> PathBuf {
        let path = std::env::var("PATH").unwrap_or_default();
        path.split(':').map(|d| Path::new(d).join("git")).find(|p| p.is_file()).expect("git on PATH")
    }

    /// Writes `text` to `path`, executable, through a child `sh`. Not with `std::fs::write`: while
    /// this process holds the file open for writing, another test's thread may fork, and its child
    /// keeps that descriptor until it execs; running the script in that moment fails with "Text
    /// file busy" (ETXTBSY: seen in CI). The file is only ever open for writing in the `sh`.
    pub fn write_executable(path: &Path, text: &str) {
        let status = std::process::Command::new("sh")
            .args(["-c", r#"printf '%s' "$1" > "$2" && chmod 755 "$2""#, "sh", text])
            .arg(path)
            .status()
            .expect("sh");
        assert!(status.success(), "writing {}: {status}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn settings(home: &Path, secs: u64) -> HostSettings {
        HostSettings { program: "git".into(), timeout: Duration::from_secs(secs), max_output: crate::relay::exec::DEFAULT_MAX_OUTPUT, committer: ("Relay".into(), "relay@x".into()), home: home.to_owned() }
    }

    fn hg(url: &str) -> HostGit {
        HostGit::new(Path::new("/tmp/x"), url, Some(&Secret::new("tok-SECRET-123")), settings(Path::new("/tmp/h"), 5))
    }

    #[test]
    fn remote_kinds() {
        for (u, k) in [
            ("https://github.com/a/b.git", RemoteKind::Http),
            ("http://127.0.0.1:1/a", RemoteKind::Http),
            ("ssh://git@ghe:2222/o/r.git", RemoteKind::Ssh),
            ("git@github.com:a/b.git", RemoteKind::Ssh),
            ("/srv/origin.git", RemoteKind::Local),
            ("file:///srv/origin.git", RemoteKind::Local),
            ("./rel/path:x", RemoteKind::Local),
            ("dir/with:colon", RemoteKind::Local),
        ] {
            assert_eq!(RemoteKind::of(u), k, "{u}");
        }
    }

    /// Only `PATH` and what the remote's kind needs come from this process; the rest is set.
    #[test]
    fn child_env_is_built_not_inherited() {
        let parent = |k: &str| -> Option<OsString> {
            match k {
                "PATH" => Some("/usr/bin".into()),
                "HTTPS_PROXY" => Some("http://proxy:3128".into()),
                "SSH_AUTH_SOCK" => Some("/run/agent".into()),
                "CLAWMUX_API_TOKEN" | "HOME" | "GIT_DIR" => Some("nope".into()),
                _ => None,
            }
        };
        let tok = Secret::new("t0k");
        let names = |kind| child_env(kind, Path::new("/tmp/h"), Some(&tok), parent).into_iter().map(|(k, v)| format!("{k}={}", v.to_string_lossy())).collect::<Vec<_>>();
        let base = ["HOME=/tmp/h", "LC_ALL=C", "GIT_TERMINAL_PROMPT=0", "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null", "GIT_ATTR_NOSYSTEM=1"];
        let with = |pre: &[&str], post: &[&str]| pre.iter().chain(base.iter()).chain(post).map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(names(RemoteKind::Http), with(&["PATH=/usr/bin", "HTTPS_PROXY=http://proxy:3128"], &["CLAWMUX_RELAY_GIT_TOKEN=t0k"]));
        assert_eq!(names(RemoteKind::Ssh), with(&["PATH=/usr/bin", "SSH_AUTH_SOCK=/run/agent"], &[]));
        assert_eq!(names(RemoteKind::Local), with(&["PATH=/usr/bin"], &[]));
    }

    #[test]
    fn token_only_for_http_and_never_in_argv() {
        let h = hg("https://github.com/a/b.git");
        let argv = h.argv(&["push", "origin", "HEAD:refs/heads/sandbox/x"]);
        assert!(argv.iter().all(|a| !a.contains("tok-SECRET-123")), "{argv:?}");
        assert!(argv.iter().any(|a| a.contains("$CLAWMUX_RELAY_GIT_TOKEN")), "the helper names the variable");
        assert_eq!(&argv[..2], &["-c", "credential.helper="], "configured helpers are dropped first");
        assert!(CREDENTIAL_HELPER.starts_with('!') && !CREDENTIAL_HELPER.contains("tok-"));
        let local = hg("/srv/origin.git");
        assert!(local.token.is_none());
        assert!(!local.argv(&["push"]).iter().any(|a| a.contains("CLAWMUX_RELAY_GIT_TOKEN")));
        assert!(hg("git@github.com:a/b.git").token.is_none());
    }

    #[test]
    fn redaction() {
        let h = hg("https://x/a/b");
        assert_eq!(h.redact("fatal: tok-SECRET-123 bad"), "fatal: <redacted> bad");
        assert_eq!(truncate("abcdef", 3), "abc…");
    }

    /// An `http` remote that demands Basic auth: git gets the token from the helper (and only
    /// from it: the argv has no token) and sends it as `x-access-token:<token>`.
    #[tokio::test]
    async fn the_token_reaches_an_http_remote_through_the_credential_helper() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let mut auths = Vec::new();
            // git asks without credentials, then with them; answer 401, then 403
            for _ in 0..2 {
                let Ok(Ok((mut s, _))) = tokio::time::timeout(Duration::from_secs(20), listener.accept()).await else { break };
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                let auth = req.lines().find_map(|l| l.strip_prefix("Authorization: ").or_else(|| l.strip_prefix("authorization: ")).map(str::to_owned));
                let resp = if auth.is_none() {
                    "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"test\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                } else {
                    "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                };
                let _ = s.write_all(resp.as_bytes()).await;
                auths.push(auth);
            }
            auths
        });
        let dir = tempfile::tempdir().expect("tmp");
        let url = format!("http://127.0.0.1:{port}/acme/widgets.git");
        let token = Secret::new("tok-HTTP-7f3a");
        let h = HostGit::new(dir.path(), &url, Some(&token), settings(dir.path(), 30));
        let out = h.run(&["ls-remote", "--", &url], None).await.expect("ran");
        assert_ne!(out.code, 0, "the fake remote refuses in the end");
        assert!(!out.stderr.contains("tok-HTTP-7f3a"));
        let auths = server.await.expect("server");
        assert_eq!(auths.len(), 2, "asked twice: {auths:?}");
        assert_eq!(auths[0], None);
        // base64("x-access-token:tok-HTTP-7f3a")
        assert_eq!(auths[1].as_deref(), Some("Basic eC1hY2Nlc3MtdG9rZW46dG9rLUhUVFAtN2YzYQ=="));
        assert!(h.argv(&["ls-remote", "--", &url]).iter().all(|a| !a.contains("tok-HTTP-7f3a")));
    }

    /// A git that prints more than the bound (on stdout or stderr): an error, not a buffer of
    /// everything, and the child is killed (and reaped) by the time it returns.
    #[tokio::test]
    async fn output_past_the_bound_is_an_error_and_the_child_is_killed() {
        let dir = tempfile::tempdir().expect("tmp");
        for (name, redirect) in [("stdout", ""), ("stderr", " >&2")] {
            let (prog, pid_file) = (dir.path().join(format!("git-{name}")), dir.path().join(format!("pid-{name}")));
            // 4 MB, then nothing until killed; `exec`: the pid written is the process that prints
            super::scripts::write_executable(&prog, &format!("#!/bin/sh\necho $$ > '{}'\nexec sh -c 'head -c 4000000 /dev/zero; exec sleep 60'{redirect}\n", pid_file.display()));
            let mut s = settings(dir.path(), 30);
            s.program = prog;
            s.max_output = 64 * 1024;
            let h = HostGit::new(dir.path(), "/nowhere", None, s);
            let t0 = std::time::Instant::now();
            let e = h.run(&["format-patch"], None).await.expect_err(name);
            assert_eq!(e, RelayError::OutputTooLarge { limit: 64 * 1024 }, "{name}");
            assert!(t0.elapsed() < Duration::from_secs(20), "{name}: not the 30 s bound");
            let pid = std::fs::read_to_string(&pid_file).expect("pid");
            assert!(!Path::new(&format!("/proc/{}", pid.trim())).exists(), "{name}: the child {} is gone", pid.trim());
        }
    }

    #[tokio::test]
    async fn runs_git_with_stdin_and_reports_failures() {
        let dir = tempfile::tempdir().expect("tmp");
        let h = HostGit::new(dir.path(), "/nowhere", None, settings(dir.path(), 20));
        h.ok(&["init", "--quiet"], None).await.expect("init");
        // patch-id reads stdin
        let o = h.ok(&["hash-object", "--stdin"], Some(b"hello\n")).await.expect("hash-object");
        assert_eq!(o.text(), "ce013625030ba8dba906f756967f9e9ca394464a");
        let e = h.ok(&["rev-parse", "--verify", "nope"], None).await.expect_err("fails");
        match e {
            RelayError::CommandFailed { what, exit_code, .. } => {
                assert_eq!(what, "host git rev-parse");
                assert_ne!(exit_code, 0);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[cfg(test)]
mod env_tests {
    //! The environment of every host git call, recorded by a wrapper `git` first on PATH, in a child
    //! test process whose own environment carries clawmux's secrets (a re-run of this test binary:
    //! no environment of this process is changed).
    use super::*;
    use std::collections::BTreeMap;

    const CHILD: &str = "CLAWMUX_TEST_HOST_ENV_LOG";
    const SECRETS: &[(&str, &str)] = &[
        ("CLAWMUX_API_TOKEN", "api-token-SECRET-1"),
        ("CLAWMUX_GATEWAY_TOKEN", "gateway-token-SECRET-2"),
        ("CLAWMUX_LLM_UPSTREAM_KEY", "llm-key-SECRET-3"),
        ("CLAWMUX_WEBHOOK_SECRET", "webhook-SECRET-4"),
        ("CLAWMUX_GITHUB_TOKEN", "tok-GITHUB-5"),
        ("GIT_DIR", "/tmp/not-a-repo-SECRET-6"),
    ];

    fn read_env(path: &Path) -> BTreeMap<String, String> {
        let raw = std::fs::read(path).expect("env file");
        raw.split(|b| *b == 0)
            .filter(|kv| !kv.is_empty())
            .filter_map(|kv| String::from_utf8_lossy(kv).split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect()
    }

    #[test]
    fn host_git_children_get_only_their_own_environment() {
        if let Some(log) = std::env::var_os(CHILD) {
            return child(Path::new(&log));
        }
        let dir = tempfile::tempdir().expect("tmp");
        let (bin, log) = (dir.path().join("bin"), dir.path().join("log"));
        std::fs::create_dir_all(&bin).expect("bin");
        std::fs::create_dir_all(&log).expect("log");
        let path = std::env::var("PATH").unwrap_or_default();
        let real = super::scripts::real_git();
        let wrapper = bin.join("git");
        // `/proc/$$/environ` is the environment the wrapper was started with, untouched by the shell
        super::scripts::write_executable(&wrapper, &format!("#!/bin/sh\ncat /proc/$$/environ > '{}/env-'$$\nexec '{}' \"$@\"\n", log.display(), real.display()));
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--exact", "relay::host::env_tests::host_git_children_get_only_their_own_environment", "--test-threads=1", "--nocapture"])
            .env(CHILD, &log)
            .env("PATH", format!("{}:{path}", bin.display()));
        for (k, v) in SECRETS {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("child test");
        assert!(out.status.success(), "child: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let envs: Vec<BTreeMap<String, String>> = std::fs::read_dir(&log).expect("log").map(|e| read_env(&e.expect("entry").path())).collect();
        assert!(envs.len() >= 3, "every host git call was recorded: {}", envs.len());
        let shown: Vec<String> = envs[0].iter().map(|(k, v)| format!("{k}={}", if SECRETS.iter().any(|(_, s)| v.contains(s)) || k == TOKEN_ENV { "<secret>" } else { v })).collect();
        eprintln!("environment of one host git call:\n  {}", shown.join("\n  "));
        let own = ["PATH", "HOME", "LC_ALL", "GIT_TERMINAL_PROMPT", "GIT_CONFIG_NOSYSTEM", "GIT_CONFIG_GLOBAL", "GIT_ATTR_NOSYSTEM", TOKEN_ENV];
        let allowed: Vec<&str> = own.iter().chain(PASS_HTTP).copied().collect();
        let home = std::env::var("HOME").unwrap_or_default();
        for env in &envs {
            for (k, v) in env {
                assert!(allowed.contains(&k.as_str()), "host git got {k} (only {allowed:?} are its own)");
                if k != TOKEN_ENV {
                    assert!(!SECRETS.iter().any(|(_, s)| v.contains(s)), "host git got a secret in {k}");
                }
            }
            assert_eq!(env.get("GIT_TERMINAL_PROMPT").map(String::as_str), Some("0"));
            assert_eq!(env.get("GIT_CONFIG_NOSYSTEM").map(String::as_str), Some("1"));
            assert_eq!(env.get("GIT_CONFIG_GLOBAL").map(String::as_str), Some("/dev/null"));
            let h = env.get("HOME").expect("HOME is set");
            assert_ne!(h, &home, "HOME is a directory of the relay's own, not clawmux's");
            assert!(h.contains("clawmux-relay-"), "{h}");
        }
        // the token only for the http remote's commands, and only the token
        let with_token = envs.iter().filter(|e| e.get(TOKEN_ENV).map(String::as_str) == Some("tok-GITHUB-5")).count();
        assert_eq!(with_token, 2, "the token goes to the http remote's git calls only");
    }

    /// In the child: host git calls for an http remote (with the token) and a local one (without).
    fn child(_log: &Path) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let tmp = tempfile::Builder::new().prefix("clawmux-relay-").tempdir().expect("tmp");
            let token = Secret::new("tok-GITHUB-5");
            let settings = super::tests::settings(&tmp.path().join("home"), 30);
            let http = HostGit::new(tmp.path(), "http://127.0.0.1:9/a/b.git", Some(&token), settings.clone());
            http.ok(&["init", "--quiet", "repo"], None).await.expect("init");
            let _ = http.run(&["ls-remote", "--", "http://127.0.0.1:9/a/b.git"], None).await.expect("ran");
            let local = HostGit::new(&tmp.path().join("repo"), "/srv/none.git", Some(&token), settings);
            local.ok(&["hash-object", "--stdin"], Some(b"x\n")).await.expect("hash-object");
        });
    }
}
