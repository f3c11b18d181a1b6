//! Which gateway process a connection reached.
//!
//! After a reconnect, a run in flight is continued (re-subscribe, `agent.wait`) only on the gateway
//! process that runs it; on a new process it was lost with the old one and must end at once, not
//! wait out its timeout for an `agent.wait` the new process can never answer.
//!
//! Protocol 4 says which process it is: `hello-ok.server.bootId` changes on every start. Protocol 3
//! has no boot id, but its `hello-ok.snapshot.uptimeMs` does the same job: the process started at
//! `now - uptime`, and two connections to one process agree on that instant within the time a
//! `hello-ok` takes to arrive, while a restarted process (seconds to start) does not.
//!
//! The identity is a string because it is stored in a run's checkpoint: a restarted clawmux
//! compares it with the gateway it reconnects to.

/// How far two estimates of one process's start may differ (the `hello-ok` transit time of each
/// connection, and the host clock's own drift between them). A real gateway takes seconds to start,
/// so a restart moves the estimate by more than this.
pub const START_TOLERANCE_MS: u64 = 2_000;

/// Longest boot id kept: it comes from the gateway and goes into every checkpoint.
const MAX_BOOT_ID: usize = 128;

const BOOT: &str = "boot:";
const STARTED: &str = "started-ms:";

/// The identity of the process behind a `hello-ok`: its boot id when it has one, else its start
/// time estimated from its uptime (`now_unix_ms` is this host's clock), else unknown.
pub fn identify(boot_id: Option<&str>, uptime_ms: Option<u64>, now_unix_ms: u64) -> Option<String> {
    if let Some(id) = boot_id.filter(|id| !id.is_empty()) {
        let mut end = id.len().min(MAX_BOOT_ID);
        while !id.is_char_boundary(end) {
            end -= 1;
        }
        return Some(format!("{BOOT}{}", &id[..end]));
    }
    uptime_ms.map(|up| format!("{STARTED}{}", now_unix_ms.saturating_sub(up)))
}

/// True when two identities name the same gateway process. Identities of different kinds (a
/// gateway upgraded from protocol 3 to 4 in between) are different processes.
pub fn same_process(a: &str, b: &str) -> bool {
    match (started(a), started(b)) {
        (Some(x), Some(y)) => x.abs_diff(y) <= START_TOLERANCE_MS,
        (None, None) => a == b,
        _ => false,
    }
}

/// Whether a run sent on process `then` is still on the process connected `now`. Without an
/// identity on either side nothing can be told, and the run is given the benefit of the doubt
/// (`agent.wait`, bounded by its own timeout).
pub fn still_there(then: Option<&str>, now: Option<&str>) -> bool {
    match (then, now) {
        (Some(a), Some(b)) => same_process(a, b),
        _ => true,
    }
}

fn started(id: &str) -> Option<u64> {
    id.strip_prefix(STARTED)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn boot_ids_win_and_are_compared_exactly() {
        let a = identify(Some("b-1"), Some(5_000), 1_000_000).expect("id");
        assert_eq!(a, "boot:b-1");
        assert!(same_process(&a, &identify(Some("b-1"), Some(90_000), 2_000_000).expect("id")));
        assert!(!same_process(&a, &identify(Some("b-2"), Some(5_000), 1_000_000).expect("id")));
    }

    #[test]
    fn protocol_3_reconnect_to_the_same_process_is_recognised() {
        // Connected at t=100 s with 10 s of uptime, reconnected at t=160 s with 70.3 s of uptime.
        let first = identify(None, Some(10_000), 100_000).expect("id");
        let again = identify(None, Some(70_300), 160_000).expect("id");
        assert!(same_process(&first, &again));
    }

    #[test]
    fn protocol_3_restart_is_a_new_process() {
        // Connected at t=100 s with 10 s of uptime; the gateway was killed and restarted, and 9 s
        // after its start clawmux reconnects at t=112 s.
        let first = identify(None, Some(10_000), 100_000).expect("id");
        let restarted = identify(None, Some(9_000), 112_000).expect("id");
        assert!(!same_process(&first, &restarted));
    }

    #[test]
    fn nothing_to_go_by_is_unknown_and_not_a_loss() {
        assert_eq!(identify(None, None, 1), None);
        assert_eq!(identify(Some(""), None, 1), None);
        assert!(still_there(None, Some("boot:x")));
        assert!(still_there(Some("boot:x"), None));
        assert!(!still_there(Some("boot:x"), Some("started-ms:5")));
    }

    #[test]
    fn hostile_values_are_bounded() {
        let long = "é".repeat(1000);
        let id = identify(Some(&long), None, 0).expect("id");
        assert!(id.len() <= BOOT.len() + MAX_BOOT_ID);
        // Uptime beyond the epoch: the estimate saturates instead of wrapping.
        assert_eq!(identify(None, Some(u64::MAX), 10).as_deref(), Some("started-ms:0"));
        // A boot id that looks like a start estimate is still a boot id.
        let tricky = identify(Some("started-ms:5"), None, 0).expect("id");
        assert!(!same_process(&tricky, "started-ms:5"));
    }

    proptest! {
        #[test]
        fn same_process_is_symmetric_and_reflexive(a in 0u64..10_000_000, b in 0u64..10_000_000) {
            let x = format!("{STARTED}{a}");
            let y = format!("{STARTED}{b}");
            prop_assert!(same_process(&x, &x));
            prop_assert_eq!(same_process(&x, &y), same_process(&y, &x));
            prop_assert_eq!(same_process(&x, &y), a.abs_diff(b) <= START_TOLERANCE_MS);
        }
    }
}
