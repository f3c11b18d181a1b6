//! `clawmux doctor`'s ephemeral checks: the runs directory is safe to use, the Docker engine
//! answers and has each ephemeral image.

use super::runner::{DockerRunner, Runner};
use crate::agents::AgentRegistry;

/// Prints one line per ephemeral image; false when a run of it could not start.
pub async fn check(agents: &AgentRegistry) -> bool {
    let runner = match DockerRunner::connect() {
        Ok(r) => r,
        Err(e) => {
            println!("ephemeral: FAILED: {e}\n  Fix: start the Docker engine or point DOCKER_HOST at it");
            return false;
        }
    };
    let mut ok = true;
    match super::EphemeralConfig::from_env(&|k| std::env::var(k).ok()) {
        Err(e) => {
            ok = false;
            println!("ephemeral runs directory: FAILED: {e}");
        }
        Ok(cfg) => match super::flow::secure_root(&cfg.root) {
            Ok(_) => println!("ephemeral runs directory: OK, {} (clawmux's own, private, below directories only root or clawmux can replace)", cfg.root.display()),
            Err(e) => {
                ok = false;
                println!("ephemeral runs directory: FAILED: {e}\n  Fix: set CLAWMUX_EPHEMERAL_DIR to a directory of clawmux's own below such directories");
            }
        },
    }
    for a in agents.agents.iter() {
        let Some(spec) = &a.ephemeral else { continue };
        match runner.check_image(&spec.image).await {
            Ok(()) => println!("ephemeral {}: OK, image {} on the engine", a.graph_id, spec.image),
            Err(e) => {
                ok = false;
                println!("ephemeral {}: FAILED: {e}\n  Fix: build it with images/build.sh ephemeral, or set the variant's image", a.graph_id);
            }
        }
    }
    ok
}
