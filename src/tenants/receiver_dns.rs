//! Where a webhook's host name may lead. The allow-list (`CLAWMUX_WEBHOOK_ALLOW`) checks names,
//! but a tenant who controls the DNS of an allowed name (`*.tenants.example`) could point it at
//! this host's loopback (clawmux's own API, the LLM proxy, the gateway) or at a link-local
//! address (a cloud's metadata service), and have clawmux post there. So a delivery resolves the
//! name itself, drops addresses of those kinds unless the allow-list names the address itself
//! with the port (`127.0.0.1:9000`: the operator's receiver on this host), and connects only to
//! what is left (pinned: a second answer of the DNS is never asked for). Private networks stay
//! reachable: receivers on them are ordinary.
//!
//! The check is made whether or not an HTTP proxy is configured (`HTTPS_PROXY` and the like: a
//! URL the proxy does not take, for its scheme or `NO_PROXY`, is connected to directly). Only a
//! name that does not resolve here at all is left to the proxy, when one is configured: the
//! proxy resolves what it forwards, and this host may not resolve names outside.

use std::net::{IpAddr, SocketAddr};

/// Metadata services at addresses no range test catches: AWS's over IPv6 (a unique local
/// address) and Alibaba Cloud's (shared address space).
const METADATA: [&str; 2] = ["fd00:ec2::254", "100.100.100.200"];

/// True for the addresses a name must not lead to: loopback, link-local, unspecified, multicast,
/// broadcast, the metadata services in [`METADATA`] (IPv4-mapped IPv6 addresses as their IPv4).
pub fn is_guarded(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    let ranges = match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified() || v4.is_multicast() || v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_unspecified() || v6.is_multicast() || v6.is_unicast_link_local(),
    };
    ranges || METADATA.iter().any(|m| m.parse::<IpAddr>().is_ok_and(|m| m == ip))
}

/// True when an HTTP proxy is configured for outgoing requests (reqwest's own environment).
pub fn proxied(env: &dyn Fn(&str) -> Option<String>) -> bool {
    ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"].iter().any(|k| env(k).is_some_and(|v| !v.trim().is_empty()))
}

/// Of `resolved` (a name's addresses, for `port`), those a delivery may connect to: not guarded,
/// or named by the allow-list with that port (or with none). `listed`: the list's addresses.
pub fn usable(resolved: &[SocketAddr], port: u16, listed: &[(IpAddr, Option<u16>)]) -> Vec<SocketAddr> {
    resolved
        .iter()
        .filter(|a| !is_guarded(a.ip()) || listed.iter().any(|(ip, p)| *ip == a.ip() && p.is_none_or(|p| p == port)))
        .copied()
        .collect()
}

/// What a receiver's host name resolved to, for a delivery.
#[derive(Debug, PartialEq)]
pub enum Resolved {
    /// The addresses it may connect to.
    Usable(Vec<SocketAddr>),
    /// Only guarded addresses, none listed: why.
    Guarded(String),
    /// It did not resolve (in time): why.
    Failed(String),
}

/// Resolves `host` for a delivery to `port`, within `within`.
pub async fn resolve(host: &str, port: u16, listed: &[(IpAddr, Option<u16>)], within: std::time::Duration) -> Resolved {
    let all: Vec<SocketAddr> = match tokio::time::timeout(within, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(a)) => a.collect(),
        Ok(Err(e)) => return Resolved::Failed(format!("cannot resolve {host}: {e}")),
        Err(_) => return Resolved::Failed(format!("cannot resolve {host}: no answer within {} s", within.as_secs_f64())),
    };
    let ok = usable(&all, port, listed);
    if ok.is_empty() {
        return Resolved::Guarded(format!(
            "{host} resolves only to loopback or link-local addresses ({}); to allow one, list it with the port in CLAWMUX_WEBHOOK_ALLOW",
            all.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    Resolved::Usable(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_link_local_and_metadata_are_guarded_private_networks_are_not() {
        for ip in ["127.0.0.1", "127.1.2.3", "169.254.169.254", "0.0.0.0", "::1", "fe80::1", "::", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "224.0.0.1", "255.255.255.255", "fd00:ec2::254", "100.100.100.200"] {
            assert!(is_guarded(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["10.0.0.5", "192.168.1.10", "172.16.0.1", "203.0.113.7", "fd00::1", "2001:db8::1", "::ffff:10.0.0.5", "100.64.0.1"] {
            assert!(!is_guarded(ip.parse().expect("ip")), "{ip}");
        }
    }

    /// A listed loopback address is usable on the listed port only: `127.0.0.1:9000` on the list
    /// does not open clawmux's other ports on this host to a name that resolves there.
    #[test]
    fn a_listed_address_is_usable_on_its_port_only() {
        let at = |port: u16| vec![SocketAddr::from(([127, 0, 0, 1], port)), SocketAddr::from(([203, 0, 113, 7], port))];
        let listed = vec![("127.0.0.1".parse().expect("ip"), Some(9000))];
        assert_eq!(usable(&at(9000), 9000, &listed), at(9000));
        assert_eq!(usable(&at(8080), 8080, &listed), vec![SocketAddr::from(([203, 0, 113, 7], 8080))]);
        let any_port = vec![("127.0.0.1".parse().expect("ip"), None)];
        assert_eq!(usable(&at(8080), 8080, &any_port), at(8080));
        assert!(usable(&at(8080)[..1], 8080, &[]).is_empty());
    }

    /// A name that does not resolve (in time) is told apart from one that leads only to guarded
    /// addresses: the first may go to a proxy, the second never.
    #[tokio::test]
    async fn resolving_tells_guarded_from_unresolved() {
        let within = std::time::Duration::from_secs(5);
        assert!(matches!(resolve("localhost", 80, &[], within).await, Resolved::Guarded(m) if m.contains("loopback")));
        let listed = [("127.0.0.1".parse().expect("ip"), Some(80)), ("::1".parse().expect("ip"), Some(80))];
        assert!(matches!(resolve("localhost", 80, &listed, within).await, Resolved::Usable(a) if !a.is_empty()));
        assert!(matches!(resolve("no-such-host.invalid", 80, &[], within).await, Resolved::Failed(_)));
    }

    #[test]
    fn a_proxy_in_the_environment_is_seen() {
        assert!(!proxied(&|_| None));
        assert!(!proxied(&|k| (k == "HTTPS_PROXY").then(|| " ".to_owned())));
        assert!(proxied(&|k| (k == "https_proxy").then(|| "http://localhost:3128".to_owned())));
    }
}
