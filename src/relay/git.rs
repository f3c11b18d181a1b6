//! Pure helpers of the relay: validation, argv builders for the git commands run in the
//! container, and parsers of their output. No I/O here.
//!
//! Every container command is `git -C <dir> <hardening> <subcommand> …` as an argv: values from a
//! request (the branch key, the base ref) are validated first AND only ever appear as single
//! arguments, never inside a shell string. The hardening switches off what a repository's own
//! config could make git run or print differently (hooks, fsmonitor, diff prefixes, colours),
//! since the agent controls that repository.

use std::collections::HashMap;

/// `git -c` settings passed to every relay git command (container and host).
pub const HARDENING: &[&str] = &[
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.quotePath=false",
    "color.ui=false",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "format.from=false",
    "format.thread=false",
    "commit.gpgSign=false",
    "advice.detachedHead=false",
];

/// Where one branch key lives in the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// The main repository, e.g. `/workspace/repo`.
    pub repo: String,
    /// The key's worktree, `/workspace/wt/<key>`.
    pub worktree: String,
    /// The branch, `sandbox/<key>`.
    pub branch: String,
}

impl Paths {
    /// Paths for `key` under the workspace root (no trailing slash needed).
    pub fn new(root: &str, key: &str) -> Self {
        let root = root.trim_end_matches('/');
        Self { repo: format!("{root}/repo"), worktree: format!("{root}/wt/{key}"), branch: format!("sandbox/{key}") }
    }
    /// `refs/heads/sandbox/<key>`.
    pub fn branch_ref(&self) -> String {
        format!("refs/heads/{}", self.branch)
    }
}

/// A branch key as the API defines it ([`crate::refname`]); `base_ref` and the protected names are
/// refused too. Callers validate first (`400`); the relay checks again before it builds any command.
pub fn validate_key(key: &str, base_ref: &str) -> Result<(), String> {
    crate::refname::validate_branch_key(key, base_ref).map_err(|r| r.to_string())
}

/// A base ref ([`crate::refname::validate_base_ref`]): a branch or tag name or a full commit id,
/// never starting with `-`.
pub fn validate_base_ref(r: &str) -> Result<(), String> {
    crate::refname::validate_base_ref(r).map_err(|r| r.to_string())
}

/// `git -C <dir> -c … <args…>`.
pub fn git(dir: &str, args: &[&str]) -> Vec<String> {
    let mut v = Vec::with_capacity(3 + 2 * HARDENING.len() + args.len());
    v.push("git".to_owned());
    v.push("-C".to_owned());
    v.push(dir.to_owned());
    for h in HARDENING {
        v.push("-c".to_owned());
        v.push((*h).to_owned());
    }
    v.extend(args.iter().map(|a| (*a).to_owned()));
    v
}

/// `worktree list --porcelain` in the main repository.
pub fn worktree_list(p: &Paths) -> Vec<String> {
    git(&p.repo, &["worktree", "list", "--porcelain"])
}

/// `worktree prune` (drops registrations whose directory is gone).
pub fn worktree_prune(p: &Paths) -> Vec<String> {
    git(&p.repo, &["worktree", "prune"])
}

/// `worktree add -b sandbox/<key> <wt> <base>`: a new branch from the base ref.
pub fn worktree_add_new(p: &Paths, base: &str) -> Vec<String> {
    git(&p.repo, &["worktree", "add", "--quiet", "-b", &p.branch, &p.worktree, base])
}

/// `worktree add <wt> sandbox/<key>`: the branch exists (its worktree directory was removed).
pub fn worktree_add_existing(p: &Paths) -> Vec<String> {
    git(&p.repo, &["worktree", "add", "--quiet", &p.worktree, &p.branch])
}

/// `rev-parse --verify --quiet <rev>^{commit}` in `dir`: exit 0 and the id, or exit 1.
pub fn verify_commit(dir: &str, rev: &str) -> Vec<String> {
    let spec = format!("{rev}^{{commit}}");
    git(dir, &["rev-parse", "--verify", "--quiet", "--end-of-options", &spec])
}

/// `rev-parse --verify --quiet refs/heads/sandbox/<key>` in the main repository.
pub fn branch_exists(p: &Paths) -> Vec<String> {
    let r = p.branch_ref();
    git(&p.repo, &["rev-parse", "--verify", "--quiet", "--end-of-options", &r])
}

/// The first part of a key (`a` of `a/b/c`): every branch that can conflict with `sandbox/<key>`
/// shares it.
pub fn key_root(key: &str) -> &str {
    key.split('/').next().unwrap_or(key)
}

/// `for-each-ref --format=%(refname) refs/heads/sandbox/<root>` in the main repository: the
/// branches that could conflict with the key's (for-each-ref matches the name and what is below it).
pub fn sandbox_branches(p: &Paths, key: &str) -> Vec<String> {
    let pattern = format!("refs/heads/sandbox/{}", key_root(key));
    git(&p.repo, &["for-each-ref", "--format=%(refname)", &pattern])
}

/// `ls-remote` patterns (tail matches) for the remote branches that could conflict with the key's.
pub fn remote_conflict_patterns(key: &str) -> [String; 2] {
    let root = key_root(key);
    [format!("refs/heads/sandbox/{root}"), format!("refs/heads/sandbox/{root}/*")]
}

/// Whether `git push --porcelain` output says the remote ref was not what the push expected: a
/// lease that no longer holds (`[rejected] (stale info)`) or, without one, a non-fast-forward.
/// Rejections by the remote itself (`[remote rejected]`, hooks) are not this.
pub fn push_was_stale(porcelain: &str) -> bool {
    porcelain.lines().any(|l| l.starts_with("!\t") && l.contains("\t[rejected] "))
}

/// `symbolic-ref --quiet HEAD` in the worktree: which branch it is on.
pub fn head_ref(p: &Paths) -> Vec<String> {
    git(&p.worktree, &["symbolic-ref", "--quiet", "HEAD"])
}

/// `rev-parse HEAD HEAD^{tree}` in the worktree (two lines).
pub fn head_and_tree(p: &Paths) -> Vec<String> {
    git(&p.worktree, &["rev-parse", "HEAD", "HEAD^{tree}"])
}

/// `rev-list --count [--merges] <base>..HEAD` in the worktree.
pub fn count_ahead(p: &Paths, base: &str, merges_only: bool) -> Vec<String> {
    let range = format!("{base}..HEAD");
    let mut args = vec!["rev-list", "--count"];
    if merges_only {
        args.push("--merges");
    }
    args.extend(["--end-of-options", range.as_str()]);
    git(&p.worktree, &args)
}

/// `merge-base <base> HEAD` in the worktree: where the branch forked from the base.
pub fn merge_base(p: &Paths, base: &str) -> Vec<String> {
    git(&p.worktree, &["merge-base", "--end-of-options", base, "HEAD"])
}

/// The flags both sides use for `format-patch`, so that the container's and the host's mboxes
/// compare: subjects kept as they are (`-k`, matched by `am -k`), no signature, no stat, and the
/// `a/` `b/` prefixes given explicitly (a repository's `format.noprefix` or `diff.noprefix` would
/// otherwise drop them; note that git 2.41+ reads ANY value of `format.noprefix`, even `false`, as
/// "no prefix", so that setting cannot be neutralised with `-c`).
pub const FORMAT_PATCH_FLAGS: &[&str] = &["format-patch", "--stdout", "-k", "--no-signature", "--no-stat", "--binary", "--full-index", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/"];

/// `format-patch --stdout … <fork>..HEAD` in the worktree.
pub fn format_patch(p: &Paths, fork: &str) -> Vec<String> {
    let range = format!("{fork}..HEAD");
    let mut args: Vec<&str> = FORMAT_PATCH_FLAGS.to_vec();
    args.push(range.as_str());
    git(&p.worktree, &args)
}

/// One entry of `git worktree list --porcelain`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WorktreeEntry {
    /// Absolute path.
    pub path: String,
    /// `refs/heads/…` when on a branch.
    pub branch: Option<String>,
    /// The directory is gone (git would prune it).
    pub prunable: bool,
}

/// Parses `git worktree list --porcelain`.
pub fn parse_worktree_list(out: &str) -> Vec<WorktreeEntry> {
    let mut v = Vec::new();
    let mut cur: Option<WorktreeEntry> = None;
    for line in out.lines() {
        if let Some(path) = line.strip_prefix("worktree ") {
            if let Some(e) = cur.take() {
                v.push(e);
            }
            cur = Some(WorktreeEntry { path: path.to_owned(), ..Default::default() });
        } else if let Some(e) = cur.as_mut() {
            if let Some(b) = line.strip_prefix("branch ") {
                e.branch = Some(b.to_owned());
            } else if line == "prunable" || line.starts_with("prunable ") {
                e.prunable = true;
            }
        }
    }
    if let Some(e) = cur {
        v.push(e);
    }
    v
}

/// A full commit id (40 or 64 lower-case hex digits).
pub fn is_object_id(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The first line of `out` when it is an object id.
pub fn parse_object_id(out: &str) -> Option<String> {
    let l = out.lines().next()?.trim();
    is_object_id(l).then(|| l.to_owned())
}

/// A decimal count on the first line.
pub fn parse_count(out: &str) -> Option<usize> {
    out.lines().next()?.trim().parse().ok()
}

/// One commit of a `format-patch --stdout` mbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Patch {
    /// The commit it was made from (the `From <id> Mon Sep 17 00:00:00 2001` line).
    pub commit: String,
    /// The mail headers (From, Date, Subject, …) as one string: with the patch id, identifies the
    /// change across the container and the host, whose commit ids differ (`git am` sets a new
    /// committer).
    pub headers: String,
    /// The whole patch, separator line included: what `git am` is fed.
    pub text: Vec<u8>,
}

/// The line `format-patch` starts every patch with.
fn separator_commit(line: &[u8]) -> Option<String> {
    let l = std::str::from_utf8(line).ok()?;
    let l = l.strip_suffix('\n').unwrap_or(l);
    let rest = l.strip_prefix("From ")?;
    let (id, tail) = rest.split_once(' ')?;
    (is_object_id(id) && tail == "Mon Sep 17 00:00:00 2001").then(|| id.to_owned())
}

/// Splits a `format-patch --stdout` mbox into its patches. Inside a patch, diff lines start with
/// ` `, `+`, `-` or `\`, so a separator line can only be one; a commit message line that imitates
/// it exactly would split wrongly, which the caller detects by comparing the count.
pub fn split_mbox(mbox: &[u8]) -> Vec<Patch> {
    let mut out: Vec<Patch> = Vec::new();
    let mut cur: Option<(String, usize)> = None;
    let mut pos = 0usize;
    while pos < mbox.len() {
        let end = mbox[pos..].iter().position(|&b| b == b'\n').map(|i| pos + i + 1).unwrap_or(mbox.len());
        if let Some(id) = separator_commit(&mbox[pos..end]) {
            if let Some((c, s)) = cur.take() {
                out.push(make_patch(c, &mbox[s..pos]));
            }
            cur = Some((id, pos));
        }
        pos = end;
    }
    if let Some((c, s)) = cur {
        out.push(make_patch(c, &mbox[s..]));
    }
    out
}

fn make_patch(commit: String, text: &[u8]) -> Patch {
    // The From, Date and Subject header fields (with their continuation lines), from the lines
    // after the separator up to the first empty line. Other fields (Message-Id, To, Cc, …) depend
    // on the side's config, not on the commit.
    let s = String::from_utf8_lossy(text);
    let mut headers = String::new();
    let mut keep = false;
    for line in s.lines().skip(1) {
        if line.is_empty() {
            break;
        }
        if line.starts_with(' ') || line.starts_with('\t') {
            if keep {
                headers.push_str(line);
                headers.push('\n');
            }
            continue;
        }
        keep = ["From:", "Date:", "Subject:"].iter().any(|h| line.starts_with(h));
        if keep {
            headers.push_str(line);
            headers.push('\n');
        }
    }
    Patch { commit, headers, text: text.to_vec() }
}

/// Parses `git patch-id --stable` output (`<patch-id> <commit-id>` per line) into commit → id.
/// Commits without changes (empty commits) have no line.
pub fn parse_patch_ids(out: &str) -> HashMap<String, String> {
    out.lines()
        .filter_map(|l| {
            let (pid, commit) = l.trim().split_once(' ')?;
            (is_object_id(pid) && is_object_id(commit)).then(|| (commit.to_owned(), pid.to_owned()))
        })
        .collect()
}

/// The identity of a change on both sides: patch id (or "empty") plus the mail headers (author,
/// date, subject). `git am` keeps all three, so a relayed commit has the same key as its source.
pub fn change_keys(patches: &[Patch], ids: &HashMap<String, String>) -> Vec<String> {
    patches.iter().map(|p| format!("{}\n{}", ids.get(&p.commit).map(String::as_str).unwrap_or("empty"), p.headers)).collect()
}

/// What to do with the container's commits, given what the remote branch already has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The remote branch carries a prefix of the container's commits: apply the rest on top
    /// (`skip` = how many the remote has already; 0 for a new branch).
    Append {
        /// Container commits already on the remote branch.
        skip: usize,
    },
    /// The remote branch has commits the container does not (someone else pushed, or the
    /// container's branch was rewritten): appending would lose or mix work.
    Diverged {
        /// Remote commits that match the container's, from the start.
        common: usize,
    },
    /// The remote branch has more commits since the fork point than the container's branch, so
    /// they cannot be a prefix of the container's: diverged too, found by counting alone (the
    /// remote's commits are not formatted, so how many match is not known).
    Longer {
        /// The remote branch's commits since the fork point.
        remote: usize,
    },
}

/// Compares the container's change keys with the remote branch's (both from the fork point).
pub fn plan(container: &[String], remote: &[String]) -> Plan {
    let common = container.iter().zip(remote).take_while(|(a, b)| a == b).count();
    if common == remote.len() {
        Plan::Append { skip: common }
    } else {
        Plan::Diverged { common }
    }
}

/// `owner/repo` from a remote URL: `https://host/owner/repo(.git)`, `ssh://git@host[:port]/owner/repo`,
/// `git@host:owner/repo.git`. Only a trailing `.git` is removed, so `widgets.js` stays.
pub fn owner_repo_from_url(url: &str) -> Option<(String, String)> {
    let url = url.trim();
    let path = if let Some(rest) = url.split_once("://").map(|(_, r)| r) {
        // host[:port]/path
        rest.split_once('/')?.1
    } else if let Some((host, path)) = url.split_once(':') {
        // scp-like git@host:owner/repo; a local path with ':' in it is not a remote we can parse
        if host.contains('/') {
            return None;
        }
        path
    } else {
        return None;
    };
    let path = path.trim_end_matches('/');
    let path = path.strip_suffix(".git").unwrap_or(path);
    let mut parts = path.rsplit('/');
    let repo = parts.next()?;
    let owner = parts.next()?;
    let ok = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) && s != "." && s != "..";
    (ok(owner) && ok(repo)).then(|| (owner.to_owned(), repo.to_owned()))
}

/// `owner/repo` from a config value.
pub fn parse_owner_repo(s: &str) -> Option<(String, String)> {
    let (o, r) = s.trim().split_once('/')?;
    owner_repo_from_url(&format!("https://x/{o}/{r}")).filter(|(oo, rr)| oo == o && rr == r)
}

/// Whether a remote URL carries credentials (`https://user:token@host/…`): refused, the token
/// goes through the credential helper only.
pub fn url_has_credentials(url: &str) -> bool {
    match url.split_once("://") {
        Some((scheme, rest)) if scheme.starts_with("http") => {
            let authority = rest.split('/').next().unwrap_or("");
            authority.contains('@')
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        let p = Paths::new("/workspace/", "task.0022");
        assert_eq!(p.repo, "/workspace/repo");
        assert_eq!(p.worktree, "/workspace/wt/task.0022");
        assert_eq!(p.branch, "sandbox/task.0022");
        assert_eq!(p.branch_ref(), "refs/heads/sandbox/task.0022");
    }

    #[test]
    fn hostile_keys_are_refused() {
        let long = "a".repeat(300);
        for k in ["../x", "-f", "a..b", "x.lock", "with space", long.as_str(), "", "/abs", "a//b", "a/", "main", "HEAD", "master", "a;rm -rf /", "$(id)", "a\nb", "-", ".hidden", "x/.y", "a@{1}", "a~1", "a^", "a:b", "x.lock/y", "x/y.lock/z"] {
            assert!(validate_key(k, "main").is_err(), "{k:?} must be refused");
        }
        assert!(validate_key("develop", "develop").is_err(), "the base ref itself is protected");
        for k in ["task.0022", "feat/x-1", "a_b", "A1"] {
            assert!(validate_key(k, "main").is_ok(), "{k:?} is fine");
        }
    }

    /// Values land as single argv elements, after the hardening and never in a shell string.
    #[test]
    fn argv_only() {
        let p = Paths::new("/workspace", "task.1");
        let a = worktree_add_new(&p, "main");
        assert_eq!(&a[..3], &["git", "-C", "/workspace/repo"]);
        assert!(!a.iter().any(|x| x == "sh" || x == "bash" || x == "-lc"));
        let tail: Vec<&str> = a[3 + 2 * HARDENING.len()..].iter().map(String::as_str).collect();
        assert_eq!(tail, ["worktree", "add", "--quiet", "-b", "sandbox/task.1", "/workspace/wt/task.1", "main"]);
        for (i, h) in HARDENING.iter().enumerate() {
            assert_eq!(a[3 + 2 * i], "-c");
            assert_eq!(a[4 + 2 * i], *h);
        }
        let f = format_patch(&p, "0123456789abcdef0123456789abcdef01234567");
        assert_eq!(f.last().map(String::as_str), Some("0123456789abcdef0123456789abcdef01234567..HEAD"));
        assert!(f.contains(&"-k".to_owned()) && f.contains(&"--stdout".to_owned()));
        let c = count_ahead(&p, "main", true);
        assert!(c.ends_with(&["--merges".to_owned(), "--end-of-options".to_owned(), "main..HEAD".to_owned()]));
        let v = verify_commit("/w", "main");
        assert_eq!(v.last().map(String::as_str), Some("main^{commit}"));
        assert_eq!(worktree_add_existing(&p).last().map(String::as_str), Some("sandbox/task.1"));
        // a hostile value would stay ONE argument even if validation were skipped
        let evil = "x; rm -rf / #";
        let m = merge_base(&p, evil);
        assert_eq!(m.iter().filter(|x| x.as_str() == evil).count(), 1);
        assert_eq!(m[m.len() - 2], evil);
        assert_eq!(m[m.len() - 3], "--end-of-options");
    }

    #[test]
    fn conflicts_and_push_status() {
        let p = Paths::new("/workspace", "a/b");
        assert_eq!(sandbox_branches(&p, "a/b").last().map(String::as_str), Some("refs/heads/sandbox/a"));
        assert_eq!(remote_conflict_patterns("a/b/c"), ["refs/heads/sandbox/a".to_owned(), "refs/heads/sandbox/a/*".to_owned()]);
        assert!(push_was_stale("To /o.git\n!\tHEAD:refs/heads/sandbox/x\t[rejected] (stale info)\nDone\n"));
        assert!(push_was_stale("!\tHEAD:refs/heads/sandbox/x\t[rejected] (non-fast-forward)\n"));
        assert!(!push_was_stale("To /o.git\n!\tHEAD:refs/heads/sandbox/x\t[remote rejected] (pre-receive hook declined)\nDone\n"));
        assert!(!push_was_stale("To /o.git\n*\tHEAD:refs/heads/sandbox/x\t[new branch]\nDone\n"));
    }

    #[test]
    fn worktree_list_parsing() {
        let out = "worktree /workspace/repo\nHEAD 1111111111111111111111111111111111111111\nbranch refs/heads/main\n\n\
worktree /workspace/wt/a\nHEAD 2222222222222222222222222222222222222222\nbranch refs/heads/sandbox/a\n\n\
worktree /workspace/wt/gone\nHEAD 3333333333333333333333333333333333333333\nbranch refs/heads/sandbox/gone\nprunable gitdir file points to non-existent location\n\n\
worktree /workspace/wt/det\nHEAD 4444444444444444444444444444444444444444\ndetached\n";
        let v = parse_worktree_list(out);
        assert_eq!(v.len(), 4);
        assert_eq!(v[1], WorktreeEntry { path: "/workspace/wt/a".into(), branch: Some("refs/heads/sandbox/a".into()), prunable: false });
        assert!(v[2].prunable);
        assert_eq!(v[3].branch, None);
    }

    #[test]
    fn ids_and_counts() {
        assert_eq!(parse_count("3\n"), Some(3));
        assert_eq!(parse_count("x"), None);
        assert_eq!(parse_object_id("0123456789abcdef0123456789abcdef01234567\nx"), Some("0123456789abcdef0123456789abcdef01234567".into()));
        assert_eq!(parse_object_id("0123"), None);
        assert_eq!(parse_object_id("0123456789ABCDEF0123456789abcdef01234567"), None);
    }

    const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

    fn mbox() -> String {
        format!(
            "From {A} Mon Sep 17 00:00:00 2001\nFrom: Agent <a@x>\nDate: Fri, 1 Jan 2026 00:00:00 +0000\nSubject: one\nMessage-Id: <1@x>\n\nbody line\nFrom {B} is not a separator\n---\ndiff --git a/f b/f\n+From {B} Mon Sep 17 00:00:00 2001\n\
From {B} Mon Sep 17 00:00:00 2001\nFrom: Agent <a@x>\nDate: Fri, 1 Jan 2026 00:00:01 +0000\nSubject: [x] two\n\n---\ndiff --git a/g b/g\n"
        )
    }

    #[test]
    fn mbox_split() {
        let m = mbox();
        let v = split_mbox(m.as_bytes());
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].commit, A);
        assert_eq!(v[1].commit, B);
        assert_eq!(v[0].headers, "From: Agent <a@x>\nDate: Fri, 1 Jan 2026 00:00:00 +0000\nSubject: one\n");
        assert_eq!(v[1].headers, "From: Agent <a@x>\nDate: Fri, 1 Jan 2026 00:00:01 +0000\nSubject: [x] two\n");
        let joined: Vec<u8> = v.iter().flat_map(|p| p.text.clone()).collect();
        assert_eq!(joined, m.as_bytes(), "the pieces are the mbox");
        assert!(split_mbox(b"").is_empty());
        assert!(split_mbox(b"garbage\n").is_empty());
    }

    #[test]
    fn patch_ids_keys_and_plan() {
        let ids = parse_patch_ids(&format!("{B} {A}\nnot a line\n"));
        assert_eq!(ids.get(A).map(String::as_str), Some(B));
        let m = mbox();
        let v = split_mbox(m.as_bytes());
        let keys = change_keys(&v, &ids);
        assert!(keys[0].starts_with(B));
        assert!(keys[1].starts_with("empty\n"));
        let c = vec!["1".to_owned(), "2".to_owned(), "3".to_owned()];
        assert_eq!(plan(&c, &[]), Plan::Append { skip: 0 });
        assert_eq!(plan(&c, &c[..2]), Plan::Append { skip: 2 });
        assert_eq!(plan(&c, &c), Plan::Append { skip: 3 });
        assert_eq!(plan(&c, &["1".to_owned(), "x".to_owned()]), Plan::Diverged { common: 1 });
        assert_eq!(plan(&c[..1], &c), Plan::Diverged { common: 1 }, "remote ahead of the container");
    }

    #[test]
    fn owner_repo() {
        let t = |u: &str| owner_repo_from_url(u).map(|(o, r)| format!("{o}/{r}"));
        assert_eq!(t("https://github.com/acme/widgets.js.git").as_deref(), Some("acme/widgets.js"));
        assert_eq!(t("https://github.com/acme/widgets.js").as_deref(), Some("acme/widgets.js"));
        assert_eq!(t("git@github.com:acme/my.repo.git").as_deref(), Some("acme/my.repo"));
        assert_eq!(t("ssh://git@ghe.local:2222/org/r.git").as_deref(), Some("org/r"));
        assert_eq!(t("https://ghe.local/prefix/org/r/").as_deref(), Some("org/r"));
        assert_eq!(t("/srv/git/origin.git"), None);
        assert_eq!(t("https://github.com/onlyowner"), None);
        assert_eq!(parse_owner_repo("acme/widgets.js"), Some(("acme".into(), "widgets.js".into())));
        assert_eq!(parse_owner_repo("acme/../x"), None);
        assert_eq!(parse_owner_repo("acme"), None);
        assert!(url_has_credentials("https://x-access-token:abc@github.com/a/b.git"));
        assert!(!url_has_credentials("https://github.com/a/b.git"));
        assert!(!url_has_credentials("git@github.com:a/b.git"));
    }
}
