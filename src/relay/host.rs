//! Host-side git: the relay's own clone of the remote, where the container's patches are applied
//! with `git am` and pushed.
//!
//! The token path: for an `http(s)` remote the token is put in the child's environment
//! (`CLAWMUX_RELAY_GIT_TOKEN`, this process's children only) and read by a credential helper given
//! as `-c credential.helper=!…`, whose text names the variable, never the value. Before it,
//! `-c credential.helper=` empties the helper list, so no configured helper (a `store` in some
//! `~/.gitconfig`) is asked or told about the token; the global and system config files are not
//! read at all (`GIT_CONFIG_GLOBAL=/dev/null`, `GIT_CONFIG_NOSYSTEM=1`), and git never prompts
//! (`GIT_TERMINAL_PROMPT=0`, no askpass). So the token is in no argv, no URL, no file, and no
//! process other than git's own helpers sees it. Local and ssh remotes get no token at all.

use super::git::HARDENING;
use super::RelayError;
use crate::config::Secret;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Name of the environment variable the credential helper reads (set on git children only).
pub const TOKEN_ENV: &str = "CLAWMUX_RELAY_GIT_TOKEN";

/// The credential helper: answers `get` with the token from [`TOKEN_ENV`]; ignores `store`/`erase`.
pub const CREDENTIAL_HELPER: &str = "!f() { test \"$1\" = get || exit 0; printf 'username=x-access-token\\npassword=%s\\n' \"$CLAWMUX_RELAY_GIT_TOKEN\"; }; f";

/// Variables of this process that would redirect or reconfigure git: removed for the children.
const SCRUBBED_ENV: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
    "GIT_EXEC_PATH",
    "GIT_TEMPLATE_DIR",
    "GIT_TRACE",
    "GIT_TRACE_CURL",
    "GIT_TRACE_PACKET",
    "GIT_CURL_VERBOSE",
];

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
    /// The token for an `http(s)` remote; `None` otherwise.
    token: Option<Secret>,
    /// Bound on one command.
    timeout: Duration,
    /// Committer identity for `git am` (the author stays the agent's).
    committer: (String, String),
}

impl HostGit {
    /// A runner in `dir`. `token` is only used when `remote_url` is `http(s)`.
    pub fn new(dir: &Path, remote_url: &str, token: Option<&Secret>, timeout: Duration, committer: (String, String)) -> Self {
        let http = remote_url.starts_with("https://") || remote_url.starts_with("http://");
        Self { dir: dir.to_owned(), token: if http { token.cloned() } else { None }, timeout, committer }
    }

    /// The same settings in another directory.
    pub fn in_dir(&self, dir: &Path) -> Self {
        Self { dir: dir.to_owned(), token: self.token.clone(), timeout: self.timeout, committer: self.committer.clone() }
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
        v.extend(["-c".into(), format!("user.name={}", self.committer.0), "-c".into(), format!("user.email={}", self.committer.1)]);
        v.extend(["-C".into(), self.dir.to_string_lossy().into_owned()]);
        for h in HARDENING {
            v.extend(["-c".into(), (*h).to_owned()]);
        }
        v.extend(args.iter().map(|a| (*a).to_owned()));
        v
    }

    /// Runs `git <args>` with `stdin` (if any); any exit code is `Ok`.
    pub async fn run(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<HostOutput, RelayError> {
        let mut cmd = tokio::process::Command::new("git");
        cmd.args(self.argv(args));
        for k in SCRUBBED_ENV {
            cmd.env_remove(k);
        }
        cmd.env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("LC_ALL", "C")
            .env_remove(TOKEN_ENV);
        if let Some(t) = &self.token {
            cmd.env(TOKEN_ENV, t.expose());
        }
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
        let out = match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Ok(r) => r.map_err(|e| RelayError::Io(format!("{what}: {e}")))?,
            Err(_) => return Err(RelayError::Timeout { what, after: self.timeout }),
        };
        if let Some(f) = feeder {
            let _ = f.await;
        }
        let stderr = self.redact(String::from_utf8_lossy(&out.stderr).trim());
        Ok(HostOutput { code: out.status.code().unwrap_or(-1), stdout: out.stdout, stderr })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hg(url: &str) -> HostGit {
        HostGit::new(Path::new("/tmp/x"), url, Some(&Secret::new("tok-SECRET-123")), Duration::from_secs(5), ("Relay".into(), "relay@x".into()))
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
        let h = HostGit::new(dir.path(), &url, Some(&token), Duration::from_secs(30), ("R".into(), "r@x".into()));
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

    #[tokio::test]
    async fn runs_git_with_stdin_and_reports_failures() {
        let dir = tempfile::tempdir().expect("tmp");
        let h = HostGit::new(dir.path(), "/nowhere", None, Duration::from_secs(20), ("R".into(), "r@x".into()));
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
