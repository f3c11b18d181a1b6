//! Running one container: the [`Runner`] trait the run flow uses (so tests drive the flow with a
//! fake) and its Docker Engine implementation ([`DockerRunner`], bollard).

use super::container::LABEL_OWNER;
use async_trait::async_trait;
use bollard::models::ContainerCreateBody;
use bollard::Docker;
use futures_util::StreamExt;
use std::collections::HashMap;

/// Why a container could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunnerError {
    /// The variant's image is not on the engine.
    #[error("the image {0:?} is not on the Docker engine (build it: images/README.md)")]
    MissingImage(String),
    /// The engine refused or is unreachable.
    #[error("the Docker engine: {0}")]
    Engine(String),
}

/// How a container ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exit {
    /// Exit code (137: killed, e.g. out of memory).
    pub code: i64,
    /// Its stdout (the envelope), at most the limit.
    pub stdout: Vec<u8>,
    /// The end of its stderr (diagnostics for a failed run).
    pub stderr_tail: String,
    /// stdout went over the limit: the caller removes the container at once.
    pub stdout_over_limit: bool,
    /// The kernel killed it for memory.
    pub oom_killed: bool,
}

/// Longest stderr tail kept.
pub const STDERR_TAIL: usize = 4096;

/// Runs containers.
#[async_trait]
pub trait Runner: Send + Sync + 'static {
    /// Creates and starts a container; returns its id.
    async fn start(&self, name: &str, body: ContainerCreateBody) -> Result<String, RunnerError>;
    /// Waits until it exits (or its stdout exceeds `stdout_limit` bytes), collecting its output.
    async fn wait(&self, id: &str, stdout_limit: usize) -> Result<Exit, RunnerError>;
    /// Kills and removes it (idempotent).
    async fn remove(&self, id: &str);
    /// Removes every container labelled as this owner's (a previous process's orphans); returns
    /// their names.
    async fn reap(&self, owner: &str) -> Result<Vec<String>, RunnerError>;
    /// The engine answers and has `image`.
    async fn check_image(&self, image: &str) -> Result<(), RunnerError>;
    /// The CPUs the engine has (`None`: unknown): a container's CPU limit above them is refused.
    async fn cpus(&self) -> Option<u32> {
        None
    }
}

/// Keeps the last `max` bytes of a growing buffer (on a char boundary when turned into text).
pub fn push_tail(tail: &mut Vec<u8>, bytes: &[u8], max: usize) {
    tail.extend_from_slice(bytes);
    if tail.len() > max {
        let cut = tail.len() - max;
        tail.drain(..cut);
    }
}

/// The Docker Engine runner.
pub struct DockerRunner {
    docker: Docker,
}

impl DockerRunner {
    /// Connects as the Docker CLI would (`DOCKER_HOST`, else the local socket).
    pub fn connect() -> Result<Self, RunnerError> {
        Docker::connect_with_defaults().map(|docker| Self { docker }).map_err(|e| RunnerError::Engine(e.to_string()))
    }
}

fn engine(e: bollard::errors::Error) -> RunnerError {
    RunnerError::Engine(e.to_string())
}

#[async_trait]
impl Runner for DockerRunner {
    async fn start(&self, name: &str, body: ContainerCreateBody) -> Result<String, RunnerError> {
        let image = body.image.clone().unwrap_or_default();
        let opts = bollard::query_parameters::CreateContainerOptions { name: Some(name.to_owned()), ..Default::default() };
        let created = match self.docker.create_container(Some(opts), body).await {
            Ok(c) => c,
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => return Err(RunnerError::MissingImage(image)),
            Err(e) => return Err(engine(e)),
        };
        if let Err(e) = self.docker.start_container(&created.id, None::<bollard::query_parameters::StartContainerOptions>).await {
            self.remove(&created.id).await;
            return Err(engine(e));
        }
        Ok(created.id)
    }

    async fn wait(&self, id: &str, stdout_limit: usize) -> Result<Exit, RunnerError> {
        let opts = bollard::query_parameters::LogsOptions { follow: true, stdout: true, stderr: true, tail: "all".to_owned(), ..Default::default() };
        let mut logs = self.docker.logs(id, Some(opts));
        let mut exit = Exit::default();
        let mut stderr = Vec::new();
        while let Some(item) = logs.next().await {
            match item.map_err(engine)? {
                bollard::container::LogOutput::StdOut { message } | bollard::container::LogOutput::Console { message } => {
                    if exit.stdout.len() + message.len() > stdout_limit {
                        exit.stdout_over_limit = true;
                        exit.stderr_tail = String::from_utf8_lossy(&stderr).into_owned();
                        return Ok(exit);
                    }
                    exit.stdout.extend_from_slice(&message);
                }
                bollard::container::LogOutput::StdErr { message } => push_tail(&mut stderr, &message, STDERR_TAIL),
                bollard::container::LogOutput::StdIn { .. } => {}
            }
        }
        exit.stderr_tail = String::from_utf8_lossy(&stderr).into_owned();
        let mut waits = self.docker.wait_container(id, None::<bollard::query_parameters::WaitContainerOptions>);
        exit.code = match waits.next().await {
            Some(Ok(r)) => r.status_code,
            Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
            Some(Err(e)) => return Err(engine(e)),
            None => return Err(RunnerError::Engine("the container's wait ended without a status".to_owned())),
        };
        if let Ok(info) = self.docker.inspect_container(id, None::<bollard::query_parameters::InspectContainerOptions>).await {
            exit.oom_killed = info.state.and_then(|s| s.oom_killed).unwrap_or(false);
        }
        Ok(exit)
    }

    async fn remove(&self, id: &str) {
        let opts = bollard::query_parameters::RemoveContainerOptions { force: true, v: true, ..Default::default() };
        match self.docker.remove_container(id, Some(opts)).await {
            Ok(()) | Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {}
            // 409: a removal is already under way.
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {}
            Err(e) => tracing::warn!(container = id, error = %e, "cannot remove an ephemeral container; the next start reaps it"),
        }
    }

    async fn reap(&self, owner: &str) -> Result<Vec<String>, RunnerError> {
        let filters = HashMap::from([("label".to_owned(), vec![format!("{LABEL_OWNER}={owner}")])]);
        let opts = bollard::query_parameters::ListContainersOptions { all: true, filters: Some(filters), ..Default::default() };
        let found = self.docker.list_containers(Some(opts)).await.map_err(engine)?;
        let mut names = Vec::new();
        for c in found {
            let Some(id) = c.id else { continue };
            self.remove(&id).await;
            names.push(c.names.and_then(|n| n.into_iter().next()).unwrap_or(id));
        }
        Ok(names)
    }

    async fn cpus(&self) -> Option<u32> {
        let info = self.docker.info().await.ok()?;
        info.ncpu.and_then(|n| u32::try_from(n).ok()).filter(|n| *n > 0)
    }

    async fn check_image(&self, image: &str) -> Result<(), RunnerError> {
        self.docker.ping().await.map_err(engine)?;
        match self.docker.inspect_image(image).await {
            Ok(_) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Err(RunnerError::MissingImage(image.to_owned())),
            Err(e) => Err(engine(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stderr_tail_keeps_the_end() {
        let mut t = Vec::new();
        for i in 0..100u8 {
            push_tail(&mut t, &[i; 10], 25);
        }
        assert_eq!(t.len(), 25);
        assert_eq!(t[24], 99);
        assert_eq!(t[0], 97);
    }
}
