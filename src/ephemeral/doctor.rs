//! `clawmux doctor`'s ephemeral checks: the Docker engine answers and has each ephemeral image.

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
