//! `clawmux keys …` and `clawmux limits …`: tenant administration on the run store directly (the
//! same store a running `clawmux serve` uses: it sees a key change at once (keys are looked up on
//! every request) and a limit change within 10 s (or at once through `/v1/admin/*`).

use crate::exit;
use crate::config::Config;
use crate::store::tenants::{Limits, TenantStore};
use crate::store::{now_ms, Retention, RunStore, StoreUrl};
use crate::tenants::keys::{self, Action};
use clap::Subcommand;
use std::sync::Arc;

/// `clawmux keys`.
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Creates a key and prints it ONCE (with its webhook signing secret).
    Create {
        /// A name for people.
        #[arg(long)]
        name: String,
        /// Billing accounts, comma-separated, or `*` for all.
        #[arg(long, value_delimiter = ',')]
        accounts: Vec<String>,
        /// Actions, comma-separated: run, read, abort, admin.
        #[arg(long, value_delimiter = ',', default_value = "run,read,abort")]
        actions: Vec<String>,
        /// Default completion webhook of the key's runs.
        #[arg(long)]
        webhook_url: Option<String>,
    },
    /// Lists keys (never their secrets).
    List,
    /// Revokes a key: refused from the next request on.
    Revoke {
        /// The key's id (the middle part of `cmx_<id>_<secret>`).
        id: String,
    },
}

/// `clawmux limits`.
#[derive(Debug, Subcommand)]
pub enum LimitsCommand {
    /// Sets an account's limits (unset options mean unlimited).
    Set {
        /// The billing account.
        account: String,
        /// Tokens per period.
        #[arg(long, requires = "period_sec")]
        max_tokens: Option<u64>,
        /// The budget period in seconds (86400: UTC days).
        #[arg(long, requires = "max_tokens")]
        period_sec: Option<u64>,
        /// Live runs at once.
        #[arg(long)]
        max_concurrent: Option<u64>,
        /// Admissions per minute.
        #[arg(long)]
        max_runs_per_minute: Option<u64>,
    },
    /// Shows an account's limits and this period's spend.
    Show {
        /// The billing account.
        account: String,
    },
}

async fn open(cfg: &Config) -> Result<Arc<dyn TenantStore>, i32> {
    if cfg.store_url == StoreUrl::Memory {
        eprintln!("clawmux: keys and limits live in the run store, and memory: is this process's alone; set CLAWMUX_STORE_URL to the store `serve` uses");
        return Err(exit::CONFIG);
    }
    let metrics = crate::store::writer::StoreMetrics::new(&prometheus::Registry::new()).map_err(|_| exit::FAILURE)?;
    let retention = Retention { max_age_ms: i64::MAX, max_count: usize::MAX };
    match RunStore::open(&cfg.store_url, retention, metrics, None).await {
        Ok(s) => Ok(s.tenants()),
        Err(e) => {
            eprintln!("clawmux: {e}");
            Err(exit::FAILURE)
        }
    }
}

/// Runs `clawmux keys …`; returns the exit code.
pub async fn keys(cfg: Config, command: KeysCommand) -> i32 {
    let store = match open(&cfg).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match command {
        KeysCommand::Create { name, accounts, actions, webhook_url } => {
            if let Err(m) = keys::validate_accounts(&accounts) {
                eprintln!("clawmux: --accounts: {m}");
                return exit::CONFIG;
            }
            let parsed: Option<Vec<Action>> = actions.iter().map(|a| Action::parse(a)).collect();
            let Some(actions) = parsed.filter(|a| !a.is_empty()) else {
                eprintln!("clawmux: --actions: one or more of run, read, abort, admin");
                return exit::CONFIG;
            };
            if let Some(url) = &webhook_url {
                if let Err(m) = crate::tenants::webhook::Allow::parse(&cfg.webhook_allow).check(url) {
                    eprintln!("clawmux: --webhook-url {m}");
                    return exit::CONFIG;
                }
            }
            let (record, token) = keys::generate(&name, accounts, actions, webhook_url, now_ms());
            if let Err(e) = store.create_key(&record).await {
                eprintln!("clawmux: {e}");
                return exit::FAILURE;
            }
            println!("key:            {token}");
            println!("id:             {}", record.id);
            println!("webhook secret: {}", record.webhook_secret);
            println!("(shown once: store them now)");
            exit::OK
        }
        KeysCommand::List => match store.keys().await {
            Ok(keys) => {
                for k in keys {
                    let state = if k.revoked_at_ms.is_some() { "revoked" } else { "active" };
                    let made_by = k.created_by.as_deref().map(|m| format!(" created_by={m}")).unwrap_or_default();
                    println!("{}  {:<8} {:<24} accounts={} actions={}{made_by}", k.id, state, k.name, k.accounts.join(","), k.actions.join(","));
                }
                exit::OK
            }
            Err(e) => {
                eprintln!("clawmux: {e}");
                exit::FAILURE
            }
        },
        KeysCommand::Revoke { id } => match store.revoke_key(&id, now_ms()).await {
            Ok(true) => {
                println!("revoked {id} (and every key it made, and they made)");
                exit::OK
            }
            Ok(false) => {
                eprintln!("clawmux: no key with id {id:?}");
                exit::FAILURE
            }
            Err(e) => {
                eprintln!("clawmux: {e}");
                exit::FAILURE
            }
        },
    }
}

/// Runs `clawmux limits …`; returns the exit code.
pub async fn limits(cfg: Config, command: LimitsCommand) -> i32 {
    let store = match open(&cfg).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let account = match &command {
        LimitsCommand::Set { account, .. } | LimitsCommand::Show { account } => account.clone(),
    };
    if !crate::request::is_valid_id(&account) {
        eprintln!("clawmux: {account:?} is not a billing account id ([A-Za-z0-9._:-]{{1,128}})");
        return exit::CONFIG;
    }
    if let LimitsCommand::Set { max_tokens, period_sec, max_concurrent, max_runs_per_minute, .. } = command {
        if period_sec == Some(0) {
            eprintln!("clawmux: --period-sec must be at least 1");
            return exit::CONFIG;
        }
        let l = Limits { max_tokens, period_sec, max_concurrent, max_runs_per_minute };
        if let Err(e) = store.set_limits(&account, &l, now_ms()).await {
            eprintln!("clawmux: {e}");
            return exit::FAILURE;
        }
    }
    match store.limits(&account).await {
        Ok(l) => {
            let l = l.unwrap_or_default();
            let spent = match (l.max_tokens, l.period_sec) {
                (Some(_), Some(p)) => store.spend(&account, crate::tenants::budget::window(p, now_ms()).0).await.ok(),
                _ => None,
            };
            println!("{}", serde_json::json!({"billingAccountId": account, "limits": l, "spentTokens": spent}));
            exit::OK
        }
        Err(e) => {
            eprintln!("clawmux: {e}");
            exit::FAILURE
        }
    }
}
