//! Where a webhook's host name may lead. The allow-list (`CLAWMUX_WEBHOOK_ALLOW`) checks names,
//! but a tenant who controls the DNS of an allowed name (`*.tenants.example`) could point it at
//! this host's loopback (clawmux's own API, the LLM proxy, the gateway) or at a link-local
//! address (a cloud's metadata service), and have clawmux post there. So a name's addresses of
//! those kinds are dropped when it is resolved for a delivery, unless the allow-list names the
//! address itself (`127.0.0.1:9000`: the operator's receiver on this host). Private networks stay
//! reachable: receivers on them are ordinary.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// True for the addresses a name must not lead to: loopback, link-local, unspecified, multicast
/// (IPv4-mapped IPv6 addresses as their IPv4).
pub fn is_guarded(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified() || v4.is_multicast() || v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.is_unspecified() || v6.is_multicast() || v6.is_unicast_link_local(),
    }
}

/// The webhook client's resolver: the system's, less the guarded addresses not listed.
pub struct GuardedResolver {
    /// Addresses the allow-list names itself.
    pub listed: Arc<Vec<IpAddr>>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let listed = self.listed.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let usable: Vec<SocketAddr> = all.iter().copied().filter(|a| !is_guarded(a.ip()) || listed.contains(&a.ip())).collect();
            if usable.is_empty() && !all.is_empty() {
                let why = format!(
                    "{host} resolves only to loopback or link-local addresses ({}); to allow one, list it in CLAWMUX_WEBHOOK_ALLOW",
                    all.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>().join(", ")
                );
                return Err(why.into());
            }
            Ok(Box::new(usable.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_link_local_and_unspecified_are_guarded_private_networks_are_not() {
        for ip in ["127.0.0.1", "127.1.2.3", "169.254.169.254", "0.0.0.0", "::1", "fe80::1", "::", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "224.0.0.1", "255.255.255.255"] {
            assert!(is_guarded(ip.parse().expect("ip")), "{ip}");
        }
        for ip in ["10.0.0.5", "192.168.1.10", "172.16.0.1", "203.0.113.7", "fd00::1", "2001:db8::1", "::ffff:10.0.0.5"] {
            assert!(!is_guarded(ip.parse().expect("ip")), "{ip}");
        }
    }
}
