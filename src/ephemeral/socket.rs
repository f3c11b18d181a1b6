//! An ephemeral run's LLM path: a unix socket served by clawmux's attribution proxy for that run
//! alone. The container reaches it through its bridge (`localhost:8080` → the socket), the only
//! way out of a `network=none` container. Every call on the socket is the run's (the socket is
//! the attribution: no trace id, no token); the proxy's rules hold as for gateway runs: billing
//! headers overwritten, the upstream key added on the host, one audit record per call, usage
//! summed into the run, streams cut when the run ends. The listener stops with the run.

use crate::attribution::RunBilling;
use crate::proxy::{ProxyState, RunScope};
use actix_web::{web, App, HttpServer};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A run's socket listener; stop it with [`RunSocket::stop`] when the run ends.
pub struct RunSocket {
    handle: actix_web::dev::ServerHandle,
}

impl RunSocket {
    /// Serves `path` (created here, world-writable so the container's non-root user can connect:
    /// its directory is mounted into that run's container only).
    pub fn start(path: &Path, proxy: web::Data<ProxyState>, billing: Arc<RunBilling>) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let scope = web::Data::new(RunScope(billing));
        let server = HttpServer::new(move || App::new().app_data(proxy.clone()).app_data(scope.clone()).configure(crate::proxy::routes))
            .workers(1)
            .disable_signals()
            .shutdown_timeout(1)
            .client_request_timeout(Duration::from_secs(60))
            .bind_uds(path)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
        }
        let server = server.run();
        let handle = server.handle();
        actix_web::rt::spawn(server);
        Ok(Self { handle })
    }

    /// Stops the listener (its in-flight calls are cut: the run has ended).
    pub async fn stop(self) {
        self.handle.stop(false).await;
    }
}
