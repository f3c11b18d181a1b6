//! API keys: their format, how they are checked, and what a caller may do (pure).
//!
//! A key is `cmx_<id>_<secret>`: the id (12 hex) finds the stored record, the secret (64 hex) is
//! compared with the stored SHA-256 in constant time. The secret is shown once, at creation. A key
//! is scoped to billing accounts (or all, `*`) and to actions; it sees, lists, re-attaches to and
//! aborts only runs of its accounts, and anything else is `404` (existence is not revealed).

use crate::store::tenants::KeyRecord;
use sha2::Digest;

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `POST /v1/runs`.
    Run,
    /// `GET /v1/runs…`, `GET /v1/agents`.
    Read,
    /// `POST /v1/runs/{id}/abort`.
    Abort,
    /// `/v1/admin/*`: keys and limits.
    Admin,
}

impl Action {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Run => "run",
            Action::Read => "read",
            Action::Abort => "abort",
            Action::Admin => "admin",
        }
    }

    /// Parses a stored or given action.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "run" => Action::Run,
            "read" => Action::Read,
            "abort" => Action::Abort,
            "admin" => Action::Admin,
            _ => return None,
        })
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// `CLAWMUX_API_TOKEN` (or a loopback caller when no token is configured, no API key exists
    /// and no proxy relayed the request: `crate::tenants::loopback`): everything.
    Admin,
    /// An API key (boxed: a record is far larger than the admin variant).
    Key(Box<KeyRecord>),
}

impl Principal {
    /// May it do `action`?
    pub fn can(&self, action: Action) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Key(k) => k.actions.iter().any(|a| a == action.as_str()),
        }
    }

    /// May it see and use runs of `account`?
    pub fn sees(&self, account: &str) -> bool {
        match self {
            Principal::Admin => true,
            Principal::Key(k) => k.accounts.iter().any(|a| a == "*" || a == account),
        }
    }

    /// The accounts a listing is limited to (`None`: all).
    pub fn account_scope(&self) -> Option<Vec<String>> {
        match self {
            Principal::Key(k) if !k.accounts.iter().any(|a| a == "*") => Some(k.accounts.clone()),
            _ => None,
        }
    }

    /// May it manage a key of `accounts` (list it, revoke it)? Only when it sees every one of
    /// them: a key with `admin` scoped to some accounts administers those, not the others (`*`
    /// only a key of `*` sees).
    pub fn governs(&self, accounts: &[String]) -> bool {
        accounts.iter().all(|a| self.sees(a))
    }

    /// May it create a key of `accounts` and `actions`? Only within its own scope: accounts it
    /// governs, actions it has (a scoped `admin` key cannot make a key wider than itself).
    pub fn may_grant(&self, accounts: &[String], actions: &[Action]) -> bool {
        self.governs(accounts) && actions.iter().all(|a| self.can(*a))
    }

    /// The key id (`None` for the admin).
    pub fn key_id(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::Key(k) => Some(&k.id),
        }
    }
}

/// A key as given: its id and secret.
#[derive(Debug, PartialEq, Eq)]
pub struct GivenKey<'a> {
    /// The id part.
    pub id: &'a str,
    /// The secret part.
    pub secret: &'a str,
}

/// Splits `cmx_<id>_<secret>`; `None` when the token does not have that shape.
pub fn parse(token: &str) -> Option<GivenKey<'_>> {
    let rest = token.strip_prefix("cmx_")?;
    let (id, secret) = rest.split_once('_')?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(id, 12) && hex(secret, 64)).then_some(GivenKey { id, secret })
}

/// SHA-256 of a secret, hex.
pub fn hash(secret: &str) -> String {
    hex::encode(sha2::Sha256::digest(secret.as_bytes()))
}

/// Equal without revealing where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// True when `given` is the key `record` stores and the key is not revoked.
pub fn matches(record: &KeyRecord, given: &GivenKey<'_>) -> bool {
    record.revoked_at_ms.is_none() && record.id == given.id && constant_time_eq(hash(given.secret).as_bytes(), record.secret_sha256.as_bytes())
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::Rng::fill(&mut rand::thread_rng(), b.as_mut_slice());
    hex::encode(b)
}

/// A new key: the record to store, the token to show once.
pub fn generate(
    name: &str,
    accounts: Vec<String>,
    actions: Vec<Action>,
    webhook_url: Option<String>,
    now_ms: i64,
) -> (KeyRecord, String) {
    let id = random_hex(6);
    let secret = random_hex(32);
    let token = format!("cmx_{id}_{secret}");
    let record = KeyRecord {
        id,
        name: name.to_owned(),
        secret_sha256: hash(&secret),
        accounts,
        actions: actions.iter().map(|a| a.as_str().to_owned()).collect(),
        webhook_secret: format!("whsec_{}", random_hex(32)),
        webhook_url,
        created_at_ms: now_ms,
        revoked_at_ms: None,
        created_by: None,
    };
    (record, token)
}

/// Validates the account list of a new key: `*` alone, or valid ids.
pub fn validate_accounts(accounts: &[String]) -> Result<(), String> {
    if accounts.is_empty() {
        return Err("a key needs at least one billing account (or *)".to_owned());
    }
    if accounts.iter().any(|a| a == "*") {
        return if accounts.len() == 1 { Ok(()) } else { Err("* stands alone: it means every account".to_owned()) };
    }
    match accounts.iter().find(|a| !crate::request::is_valid_id(a)) {
        Some(bad) => Err(format!("{bad:?} is not a billing account id ([A-Za-z0-9._:-]{{1,128}})")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key with `admin` administers its own accounts only: it grants no account and no action
    /// it lacks itself, and governs no key with an account outside its scope (before, `admin`
    /// alone was checked: a scoped admin key could make a `*` key and manage every tenant).
    #[test]
    fn a_scoped_admin_key_governs_and_grants_only_within_its_scope() {
        let (rec, _) = generate("t", vec!["a".into(), "b".into()], vec![Action::Admin, Action::Read], None, 1);
        let k = Principal::Key(Box::new(rec));
        let acc = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<String>>();
        assert!(k.governs(&acc(&["a"])) && k.governs(&acc(&["a", "b"])));
        assert!(!k.governs(&acc(&["c"])) && !k.governs(&acc(&["a", "c"])) && !k.governs(&acc(&["*"])));
        assert!(k.may_grant(&acc(&["b"]), &[Action::Read]));
        assert!(k.may_grant(&acc(&["a"]), &[Action::Admin]));
        assert!(!k.may_grant(&acc(&["b"]), &[Action::Run]), "an action it lacks");
        assert!(!k.may_grant(&acc(&["*"]), &[Action::Read]), "all accounts");
        let (all, _) = generate("w", vec!["*".into()], vec![Action::Admin], None, 1);
        let w = Principal::Key(Box::new(all));
        assert!(w.governs(&acc(&["*"])) && w.governs(&acc(&["c"])) && w.may_grant(&acc(&["*"]), &[Action::Admin]));
        assert!(!w.may_grant(&acc(&["c"]), &[Action::Run]));
        assert!(Principal::Admin.may_grant(&acc(&["*"]), &[Action::Run, Action::Admin]));
    }

    #[test]
    fn a_generated_key_matches_until_revoked() {
        let (mut rec, token) = generate("ci", vec!["a".into()], vec![Action::Run, Action::Read], None, 1);
        let given = parse(&token).expect("own format");
        assert!(matches(&rec, &given));
        assert!(!token.contains(&rec.secret_sha256), "the stored hash is not the secret");
        let wrong = format!("cmx_{}_{}", rec.id, "0".repeat(64));
        assert!(!matches(&rec, &parse(&wrong).expect("shape")));
        rec.revoked_at_ms = Some(2);
        assert!(!matches(&rec, &given));
    }

    #[test]
    fn only_the_key_shape_parses() {
        for bad in ["", "cmx_", "cmx_abc_def", "Bearer x", &format!("cmx_{}_{}", "g".repeat(12), "0".repeat(64)), &format!("cmx_{}{}", "a".repeat(12), "0".repeat(64))] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn scopes() {
        let (rec, _) = generate("k", vec!["a".into(), "b".into()], vec![Action::Read], None, 1);
        let p = Principal::Key(Box::new(rec));
        assert!(p.sees("a") && p.sees("b") && !p.sees("c"));
        assert!(p.can(Action::Read) && !p.can(Action::Run) && !p.can(Action::Admin));
        assert_eq!(p.account_scope(), Some(vec!["a".into(), "b".into()]));
        let (all, _) = generate("k", vec!["*".into()], vec![Action::Run], None, 1);
        assert!(Principal::Key(Box::new(all.clone())).sees("anything"));
        assert_eq!(Principal::Key(Box::new(all)).account_scope(), None);
        assert!(Principal::Admin.can(Action::Admin) && Principal::Admin.sees("x"));
        assert!(validate_accounts(&["*".into(), "a".into()]).is_err());
        assert!(validate_accounts(&[]).is_err());
        assert!(validate_accounts(&["a b".into()]).is_err());
    }
}
