//! Branch keys and base refs: git's own ref-name rules, plus clawmux's stricter ones. Pure.
//!
//! A branch key `K` becomes the branch `sandbox/K` (a git ref `refs/heads/sandbox/K`) and the
//! worktree directory `<root>/wt/K`. [`git_ref_rule`] is git's `check_refname_format` (what
//! `git check-ref-format --branch` applies), rule for rule, so a key refused by git is refused
//! here, before any run exists, with the rule it breaks; a property test checks it against the
//! real `git check-ref-format --branch sandbox/<key>`. clawmux is stricter than git in four
//! documented ways ([`KeyRule`]): a short character set (git also allows `@`, `+`, `#`, `!`,
//! non-ASCII, …), at most 100 characters, no leading `-` (it would read as an option to every
//! tool that gets the worktree path), and the protected names.

/// A rule of git's ref-name format (`git help check-ref-format`) that a name breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GitRule {
    /// The whole name is `@`.
    LoneAt,
    /// An empty part: a leading or trailing `/`, or `//`.
    EmptyComponent,
    /// A part (between slashes) starts with `.`.
    ComponentStartsWithDot,
    /// A part ends with `.lock`.
    ComponentEndsWithLock,
    /// `..` anywhere.
    DoubleDot,
    /// `@{` anywhere.
    AtBrace,
    /// An ASCII control character, space, `~`, `^`, `:`, `?`, `*`, `[` or `\`.
    ForbiddenChar(char),
    /// The name ends with `.`.
    EndsWithDot,
}

impl std::fmt::Display for GitRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::LoneAt => f.write_str("must not be '@' (git's ref-name rule)"),
            Self::EmptyComponent => f.write_str("must not start or end with '/' or contain '//' (git's ref-name rule)"),
            Self::ComponentStartsWithDot => f.write_str("no part between slashes may start with '.' (git's ref-name rule)"),
            Self::ComponentEndsWithLock => f.write_str("no part between slashes may end with '.lock' (git's ref-name rule)"),
            Self::DoubleDot => f.write_str("must not contain '..' (git's ref-name rule)"),
            Self::AtBrace => f.write_str("must not contain '@{' (git's ref-name rule)"),
            Self::ForbiddenChar(c) => write!(
                f,
                "must not contain {c:?}: control characters, space, '~', '^', ':', '?', '*', '[' and '\\' are not allowed (git's ref-name rule)"
            ),
            Self::EndsWithDot => f.write_str("must not end with '.' (git's ref-name rule)"),
        }
    }
}

/// git's `check_refname_format(name, 0)` for a name of two or more parts (`sandbox/<key>`,
/// `refs/heads/<base>`): the first rule `name` breaks, in git's own order.
pub fn git_ref_rule(name: &str) -> Option<GitRule> {
    if name == "@" {
        return Some(GitRule::LoneAt);
    }
    for part in name.split('/') {
        if part.is_empty() {
            return Some(GitRule::EmptyComponent);
        }
        let mut last = '\0';
        for c in part.chars() {
            match c {
                '.' if last == '.' => return Some(GitRule::DoubleDot),
                '{' if last == '@' => return Some(GitRule::AtBrace),
                c if c.is_ascii_control() || matches!(c, ' ' | '~' | '^' | ':' | '?' | '*' | '[' | '\\') => return Some(GitRule::ForbiddenChar(c)),
                _ => {}
            }
            last = c;
        }
        if part.starts_with('.') {
            return Some(GitRule::ComponentStartsWithDot);
        }
        if part.ends_with(".lock") {
            return Some(GitRule::ComponentEndsWithLock);
        }
    }
    name.ends_with('.').then_some(GitRule::EndsWithDot)
}

/// Why a branch key or base ref is refused: one of clawmux's own rules, or git's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRule {
    /// clawmux: 1 to `max` bytes.
    Length {
        /// The bound.
        max: usize,
    },
    /// clawmux: only `[A-Za-z0-9._/-]` (git allows more).
    Charset,
    /// clawmux: no leading `-` (git allows `sandbox/-x`).
    LeadingDash,
    /// clawmux: `main`, `master`, `HEAD` and the base ref are never branch keys (any case).
    Protected,
    /// clawmux: a base ref must not be `HEAD`, another worktree's (`worktrees/…`,
    /// `main-worktree/…`) or a pseudo-ref (`FETCH_HEAD`, …): they name whatever is checked out.
    Head,
    /// git's ref-name rules on `sandbox/<key>` (or `refs/heads/<base>`).
    Git(GitRule),
}

impl std::fmt::Display for KeyRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Length { max } => write!(f, "must be 1 to {max} characters (clawmux's rule)"),
            Self::Charset => f.write_str("may contain only letters, digits, '.', '_', '/' and '-' (clawmux's rule, stricter than git's)"),
            Self::LeadingDash => f.write_str("must not start with '-' (clawmux's rule, stricter than git's)"),
            Self::Protected => f.write_str("is a protected name: main, master, HEAD and the base ref are never branch keys (clawmux's rule)"),
            Self::Head => f.write_str(
                "must name a branch, tag or commit, not HEAD, another worktree's HEAD or refs (worktrees/…, main-worktree/…) or a pseudo-ref like FETCH_HEAD (clawmux's rule)",
            ),
            Self::Git(r) => r.fmt(f),
        }
    }
}

/// Longest branch key.
pub const MAX_KEY_LEN: usize = 100;
/// Longest base ref.
pub const MAX_BASE_REF_LEN: usize = 200;

fn clawmux_charset(s: &str, max: usize) -> Result<(), KeyRule> {
    if !(1..=max).contains(&s.len()) {
        return Err(KeyRule::Length { max });
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-')) {
        return Err(KeyRule::Charset);
    }
    if s.starts_with('-') {
        return Err(KeyRule::LeadingDash);
    }
    Ok(())
}

/// A branch key: clawmux's character set and length, no leading `-`, git's rules on
/// `sandbox/<key>`, and not a protected name (`main`, `master`, `HEAD`, `base_ref`; any case).
pub fn validate_branch_key(key: &str, base_ref: &str) -> Result<(), KeyRule> {
    clawmux_charset(key, MAX_KEY_LEN)?;
    if let Some(r) = git_ref_rule(&format!("sandbox/{key}")) {
        return Err(KeyRule::Git(r));
    }
    if ["main", "master", "head", base_ref].iter().any(|p| key.eq_ignore_ascii_case(p)) {
        return Err(KeyRule::Protected);
    }
    Ok(())
}

/// A base ref: a branch or tag name or a full commit id, in clawmux's character set, at most 200
/// characters, no leading `-`, not `HEAD`, and valid for git as `refs/heads/<base>`.
pub fn validate_base_ref(r: &str) -> Result<(), KeyRule> {
    clawmux_charset(r, MAX_BASE_REF_LEN)?;
    // Nor what names whatever a run has checked out: all runs' worktrees share one repository, so
    // another worktree's HEAD or refs (`worktrees/<id>/…`, `main-worktree/…`) or a pseudo-ref
    // (`FETCH_HEAD`, `ORIG_HEAD`, …) could be another account's work.
    let first = r.split('/').next().unwrap_or(r);
    if r == "HEAD" || first == "worktrees" || first == "main-worktree" || (!r.contains('/') && r.ends_with("_HEAD")) {
        return Err(KeyRule::Head);
    }
    match git_ref_rule(&format!("refs/heads/{r}")) {
        Some(rule) => Err(KeyRule::Git(rule)),
        None => Ok(()),
    }
}

/// The branch key whose sandbox branch a base ref names, in any spelling git resolves to it in
/// the relay's repositories (`sandbox/K`, `heads/sandbox/K`, `refs/heads/sandbox/K`,
/// `<remote>/sandbox/K`, `remotes/<remote>/sandbox/K`, `refs/remotes/<remote>/sandbox/K`, for any
/// remote name; so also a branch `x/sandbox/K`, which is taken for remote `x`'s); `None` for any
/// other ref. A base ref cannot carry revision syntax (`~`, `^`, `@{…}`: the character set
/// refuses them), so this is every way to name the branch by name; a commit id is not resolved.
pub fn sandbox_key_of_base_ref(base_ref: &str) -> Option<&str> {
    fn after_first(r: &str) -> Option<&str> {
        r.split_once('/').map(|(_, rest)| rest)
    }
    let r = base_ref.strip_prefix("refs/").unwrap_or(base_ref);
    if r.starts_with("tags/") {
        // A tag, which the relay never makes.
        return None;
    }
    let r = r.strip_prefix("heads/").or_else(|| r.strip_prefix("remotes/").and_then(after_first)).unwrap_or(r);
    // `<remote>/sandbox/K`, whatever the remote is called (git tries `refs/remotes/<name>`).
    let r = match after_first(r) {
        Some(rest) if !r.starts_with("sandbox/") && rest.starts_with("sandbox/") => rest,
        _ => r,
    };
    r.strip_prefix("sandbox/").filter(|k| !k.is_empty())
}

/// The branches that make `sandbox/<key>` impossible to create in a repository holding `refs`
/// (full names, `refs/heads/…` or `refs/remotes/origin/…`, any order): git stores `a` and `a/b`
/// as a file and a directory of the same name, so one blocks the other. The key's own branch is
/// not a conflict. Returns the conflicting branch names (`sandbox/…`), sorted.
pub fn conflicting_branches<'a>(key: &str, refs: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mine = format!("sandbox/{key}");
    let mut out: Vec<String> = refs
        .into_iter()
        .filter_map(|r| r.strip_prefix("refs/heads/").or_else(|| r.strip_prefix("refs/remotes/origin/")).or_else(|| r.strip_prefix("refs/")))
        .filter(|b| {
            *b != mine && (mine.strip_prefix(*b).is_some_and(|rest| rest.starts_with('/')) || b.strip_prefix(mine.as_str()).is_some_and(|rest| rest.starts_with('/')))
        })
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::process::Command;

    #[test]
    fn a_base_ref_naming_a_sandbox_branch_gives_its_key_in_every_spelling() {
        for r in [
            "sandbox/a/b",
            "heads/sandbox/a/b",
            "refs/heads/sandbox/a/b",
            "origin/sandbox/a/b",
            "remotes/origin/sandbox/a/b",
            "refs/remotes/origin/sandbox/a/b",
            "upstream/sandbox/a/b",
            "refs/remotes/upstream/sandbox/a/b",
        ] {
            assert_eq!(sandbox_key_of_base_ref(r), Some("a/b"), "{r}");
        }
        for r in ["main", "sandbox", "sandbox/", "origin/main", "refs/tags/sandbox/x", "sandboxes/x", "a/b/sandbox/x", "0123456789abcdef0123456789abcdef01234567"] {
            assert_eq!(sandbox_key_of_base_ref(r), None, "{r}");
        }
    }

    /// `git check-ref-format --branch <name>`, outside any repository (no `@{-N}` expansion).
    fn git_accepts_branch(name: &str) -> bool {
        let dir = std::env::temp_dir();
        Command::new("git")
            .args(["check-ref-format", "--branch", name])
            .current_dir(&dir)
            .env("GIT_CEILING_DIRECTORIES", dir.parent().unwrap_or(&dir))
            .env_remove("GIT_DIR")
            .output()
            .map(|o| o.status.success())
            .expect("git runs")
    }

    #[test]
    fn the_issue_s_keys() {
        // a `.lock` at the end of a middle part passed before and failed inside the container
        for k in ["x.lock/y", "x/y.lock/z", "a/.b", "a.lock"] {
            assert!(!git_accepts_branch(&format!("sandbox/{k}")), "git refuses {k}");
            assert_eq!(validate_branch_key(k, "main"), Err(KeyRule::Git(if k == "a/.b" { GitRule::ComponentStartsWithDot } else { GitRule::ComponentEndsWithLock })), "{k}");
        }
        assert_eq!(validate_branch_key("a./b", "main"), Ok(()), "a part may end with '.' (only the name may not)");
        assert!(git_accepts_branch("sandbox/a./b"));
    }

    #[test]
    fn clawmux_is_stricter_where_it_says() {
        for (k, rule) in [("-x", KeyRule::LeadingDash), ("a@b", KeyRule::Charset), ("é", KeyRule::Charset), ("a+b", KeyRule::Charset), ("MAIN", KeyRule::Protected), ("head", KeyRule::Protected), ("dev", KeyRule::Protected)] {
            assert!(git_accepts_branch(&format!("sandbox/{k}")), "git accepts {k}");
            assert_eq!(validate_branch_key(k, "dev"), Err(rule), "{k}");
        }
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(git_accepts_branch(&format!("sandbox/{long}")));
        assert_eq!(validate_branch_key(&long, "main"), Err(KeyRule::Length { max: MAX_KEY_LEN }));
        assert_eq!(validate_branch_key("", "main"), Err(KeyRule::Length { max: MAX_KEY_LEN }));
    }

    #[test]
    fn base_refs() {
        for r in ["main", "release/1.2", "v1.0.0", "0123456789abcdef0123456789abcdef01234567", "a./b", "my_HEAD/x", "team/worktrees"] {
            assert_eq!(validate_base_ref(r), Ok(()), "{r}");
        }
        // What names whatever a run (another account's, perhaps) has checked out.
        for r in ["HEAD", "worktrees/shared/HEAD", "worktrees/shared1/refs/bisect/bad", "main-worktree/HEAD", "FETCH_HEAD", "ORIG_HEAD", "MERGE_HEAD"] {
            assert_eq!(validate_base_ref(r), Err(KeyRule::Head), "{r}");
        }
        for r in ["", "-x", "--upload-pack=evil", "a..b", "a b", "a^", "a~1", "HEAD@{1}", "a.lock", "/a", ".a", "a/", "HEAD", "x.lock/y", "a/.b", "a."] {
            assert!(validate_base_ref(r).is_err(), "{r:?}");
        }
    }

    #[test]
    fn conflicts() {
        let refs = ["refs/heads/main", "refs/heads/sandbox/a", "refs/heads/sandbox/ab", "refs/remotes/origin/sandbox/c/d", "refs/heads/sandbox/e/f/g"];
        assert_eq!(conflicting_branches("a/b", refs), ["sandbox/a"]);
        assert_eq!(conflicting_branches("a", refs), Vec::<String>::new(), "its own branch, and a sibling that shares a prefix");
        assert_eq!(conflicting_branches("c", refs), ["sandbox/c/d"]);
        assert_eq!(conflicting_branches("e/f", refs), ["sandbox/e/f/g"]);
        assert_eq!(conflicting_branches("e/f/g/h", refs), ["sandbox/e/f/g"]);
        assert_eq!(conflicting_branches("e", refs), ["sandbox/e/f/g"]);
        assert_eq!(conflicting_branches("x", refs), Vec::<String>::new());
    }

    /// Parts that hit git's rules often: every forbidden character, `.lock`, `..`, `@{`, slashes.
    fn any_key() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            4 => proptest::sample::select(vec!["a", "b", "Z", "0", "9", "-", "_", ".", "/", "@", "{", "}", "~", "^", ":", "?", "*", "[", "]", "\\", " ", "\t", "\n", "\x7f", "\x01", "é", "+", "#", "!", "l", "o", "c", "k"]),
            1 => proptest::sample::select(vec![".lock", "..", "@{", "//", "/.", ".lock/", "HEAD", "main"]),
        ];
        proptest::collection::vec(piece, 0..10).prop_map(|v| v.concat())
    }

    /// Keys in clawmux's own character set.
    fn charset_key() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            4 => proptest::sample::select(vec!["a", "B", "7", "-", "_", ".", "/", "l", "o", "c", "k"]),
            1 => proptest::sample::select(vec![".lock", "..", "//", "/.", ".lock/", "x.lock/y"]),
        ];
        proptest::collection::vec(piece, 1..10).prop_map(|v| v.concat())
    }

    fn field_message(key: &str) -> Option<String> {
        let body = serde_json::json!({"message": "m", "billingAccountId": "a", "branch": {"branchName": key}});
        let limits = crate::request::Limits { max_message_bytes: 100, default_timeout_sec: 60, max_timeout_sec: 60 };
        let req = crate::request::decode(body.to_string().as_bytes()).expect("decodes");
        match crate::request::validate(req, limits, || "r".to_owned()) {
            Ok(_) => None,
            Err(crate::request::RequestError::Invalid(m)) => Some(m),
            Err(e) => panic!("{e:?}"),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

        /// git's rules, modelled exactly: `git_ref_rule("sandbox/<key>")` is `None` exactly when
        /// `git check-ref-format --branch sandbox/<key>` accepts; every key clawmux accepts git
        /// accepts; every refused key is a 400 that names the field and the rule.
        #[test]
        fn git_rules_match_git_check_ref_format(key in any_key()) {
            let name = format!("sandbox/{key}");
            let git = git_accepts_branch(&name);
            prop_assert_eq!(git_ref_rule(&name).is_none(), git, "{:?}: ours {:?}", name, git_ref_rule(&name));
            let ours = validate_branch_key(&key, "main");
            if ours.is_ok() {
                prop_assert!(git, "clawmux accepted {:?}, git refuses it", key);
            }
            match (ours, field_message(&key)) {
                (Ok(()), None) => {}
                (Err(rule), Some(m)) => prop_assert!(m.contains("`branch.branchName`") && m.contains(&rule.to_string()), "{:?}: {}", key, m),
                (o, m) => prop_assert!(false, "{:?}: {:?} vs {:?}", key, o, m),
            }
        }

        /// Inside clawmux's character set, clawmux refuses exactly what git refuses, plus its
        /// documented extras (length, leading '-', protected names).
        #[test]
        fn within_the_charset_clawmux_equals_git(key in charset_key()) {
            let git = git_accepts_branch(&format!("sandbox/{key}"));
            match validate_branch_key(&key, "main") {
                Ok(()) => prop_assert!(git, "{:?}", key),
                Err(KeyRule::Git(_)) => prop_assert!(!git, "{:?}", key),
                Err(KeyRule::Length { .. } | KeyRule::LeadingDash | KeyRule::Protected) => {}
                Err(other) => prop_assert!(false, "{:?}: {:?}", key, other),
            }
        }
    }
}
