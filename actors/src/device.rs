//! clawmux's device identity: an Ed25519 key pair, created once, kept in a file only its owner can
//! read, and used to sign the `connect` of every connection.
//!
//! Gateways that bind scopes to a device (protocol 3 always; protocol 4 for remote connections)
//! want `device: {id, publicKey, signature, signedAt, nonce}` in `connect`. Both 2026.4.12 and
//! 2026.9.6 sign the same payload (read from their own clients, `buildDeviceAuthPayloadV3`):
//!
//! ```text
//! v3|<deviceId>|<client.id>|<client.mode>|<role>|<scopes joined by ,>|<signedAtMs>|<token or "">|<nonce>|<platform lower>|<deviceFamily lower or "">
//! ```
//! `deviceId` is the hex SHA-256 of the raw 32-byte public key; `publicKey` and `signature` are
//! base64url without padding.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ed25519_dalek::{Signer, SigningKey};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// A loaded identity. The private key never leaves this struct (no `Debug` of it, no logging).
pub struct DeviceIdentity {
    key: SigningKey,
    device_id: String,
    public_key: String,
    path: PathBuf,
}

impl std::fmt::Debug for DeviceIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceIdentity").field("device_id", &self.device_id).field("path", &self.path).finish_non_exhaustive()
    }
}

/// Why the key file could not be used. Every message names the file and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// Reading, creating or writing the file failed.
    #[error("device key file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file exists but is not a clawmux device key.
    #[error("device key file {path} is corrupt ({reason}); move it away to create a new identity (the gateway must then approve the new device)")]
    Corrupt {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Others can read the private key.
    #[error("device key file {path} is readable by other users (mode {mode:o}); run `chmod 600 {path}`")]
    TooOpen {
        /// The file.
        path: String,
        /// Its mode.
        mode: u32,
    },
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyFile {
    version: u32,
    device_id: String,
    public_key: String,
    private_key: String,
}

/// The fields of `connect.device`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceProof {
    /// Device id.
    pub id: String,
    /// Raw public key, base64url.
    pub public_key: String,
    /// Signature of the payload, base64url.
    pub signature: String,
    /// Signing time in ms.
    pub signed_at: u64,
    /// The challenge nonce.
    pub nonce: String,
}

/// What is signed (besides the identity's own id).
#[derive(Debug, Clone)]
pub struct SignParams<'a> {
    /// `client.id`.
    pub client_id: &'a str,
    /// `client.mode`.
    pub client_mode: &'a str,
    /// `role`.
    pub role: &'a str,
    /// Requested scopes, in the order sent.
    pub scopes: &'a [String],
    /// Signing time (the challenge's `ts` when given).
    pub signed_at_ms: u64,
    /// The shared token, when one is sent.
    pub token: Option<&'a str>,
    /// Challenge nonce.
    pub nonce: &'a str,
    /// `client.platform`.
    pub platform: &'a str,
    /// `client.deviceFamily`.
    pub device_family: Option<&'a str>,
}

/// The payload string the gateway verifies (pure; see the module docs).
pub fn payload(device_id: &str, p: &SignParams<'_>) -> String {
    [
        "v3",
        device_id,
        p.client_id,
        p.client_mode,
        p.role,
        &p.scopes.join(","),
        &p.signed_at_ms.to_string(),
        p.token.unwrap_or(""),
        p.nonce,
        &p.platform.trim().to_ascii_lowercase(),
        &p.device_family.unwrap_or("").trim().to_ascii_lowercase(),
    ]
    .join("|")
}

fn device_id_of(public: &[u8; 32]) -> String {
    let digest = Sha256::digest(public);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

impl DeviceIdentity {
    /// Loads the identity from `path`, creating it (mode 0600) when the file does not exist.
    pub fn load_or_create(path: &Path) -> Result<Self, DeviceError> {
        let shown = path.display().to_string();
        let io = |source| DeviceError::Io { path: shown.clone(), source };
        match std::fs::read(path) {
            Ok(bytes) => {
                check_mode(path)?;
                Self::parse(&bytes, path)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = SigningKey::generate(&mut rand::rngs::OsRng);
                let id = Self::from_key(key, path.to_owned());
                match id.write_new(path) {
                    Ok(()) => {
                        tracing::info!(device_id = %id.device_id, path = %shown, "created a new device identity");
                        Ok(id)
                    }
                    // Another process created it first: use that one.
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                        let bytes = std::fs::read(path).map_err(io)?;
                        Self::parse(&bytes, path)
                    }
                    Err(e) => Err(io(e)),
                }
            }
            Err(e) => Err(io(e)),
        }
    }

    fn from_key(key: SigningKey, path: PathBuf) -> Self {
        let public = key.verifying_key().to_bytes();
        Self { device_id: device_id_of(&public), public_key: URL_SAFE_NO_PAD.encode(public), key, path }
    }

    fn parse(bytes: &[u8], path: &Path) -> Result<Self, DeviceError> {
        let corrupt = |reason: String| DeviceError::Corrupt { path: path.display().to_string(), reason };
        let file: KeyFile = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if file.version != 1 {
            return Err(corrupt(format!("unknown version {}", file.version)));
        }
        let seed = URL_SAFE_NO_PAD.decode(file.private_key.as_bytes()).map_err(|e| corrupt(format!("private key: {e}")))?;
        let seed: [u8; 32] = seed.try_into().map_err(|_| corrupt("private key is not 32 bytes".to_owned()))?;
        let id = Self::from_key(SigningKey::from_bytes(&seed), path.to_owned());
        if id.public_key != file.public_key || id.device_id != file.device_id {
            return Err(corrupt("public key or device id do not match the private key".to_owned()));
        }
        Ok(id)
    }

    fn write_new(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        #[cfg(unix)]
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = KeyFile {
            version: 1,
            device_id: self.device_id.clone(),
            public_key: self.public_key.clone(),
            private_key: URL_SAFE_NO_PAD.encode(self.key.to_bytes()),
        };
        let text = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
        // Unique per attempt, not per process: two starts in one process (tests, a restart in
        // place) must not collide on the temporary file and mistake that for the key existing.
        let tmp = path.with_extension(format!("tmp-{}-{:016x}", std::process::id(), rand::random::<u64>()));
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        opts.mode(0o600);
        let mut f = opts.open(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        drop(f);
        // A hard link never replaces an existing file: when two processes create a key at once,
        // exactly one wins and the other one's key is discarded.
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        linked
    }

    /// The device id the gateway shows (`openclaw devices list`; approval takes the pending request id).
    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    /// Where the key lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Signs a connect.
    pub fn prove(&self, p: &SignParams<'_>) -> DeviceProof {
        let payload = payload(&self.device_id, p);
        let signature = self.key.sign(payload.as_bytes());
        DeviceProof {
            id: self.device_id.clone(),
            public_key: self.public_key.clone(),
            signature: URL_SAFE_NO_PAD.encode(signature.to_bytes()),
            signed_at: p.signed_at_ms,
            nonce: p.nonce.to_owned(),
        }
    }
}

#[cfg(unix)]
fn check_mode(path: &Path) -> Result<(), DeviceError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|source| DeviceError::Io { path: path.display().to_string(), source })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(DeviceError::TooOpen { path: path.display().to_string(), mode });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_mode(_path: &Path) -> Result<(), DeviceError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signature, Verifier, VerifyingKey};

    fn tmp() -> PathBuf {
        std::env::temp_dir().join(format!("clawmux-device-{}", uuid::Uuid::new_v4())).join("device-key.json")
    }

    fn params<'a>(scopes: &'a [String]) -> SignParams<'a> {
        SignParams {
            client_id: "gateway-client",
            client_mode: "backend",
            role: "operator",
            scopes,
            signed_at_ms: 1_795_237_451_166,
            token: Some("tok"),
            nonce: "n-1",
            platform: "Linux",
            device_family: None,
        }
    }

    #[test]
    fn payload_matches_the_gateways_format() {
        let scopes = vec!["operator.read".to_owned(), "operator.write".to_owned()];
        assert_eq!(
            payload("dev", &params(&scopes)),
            "v3|dev|gateway-client|backend|operator|operator.read,operator.write|1795237451166|tok|n-1|linux|"
        );
    }

    #[test]
    fn created_once_owner_only_and_reused() {
        let path = tmp();
        let a = DeviceIdentity::load_or_create(&path).expect("created");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        let b = DeviceIdentity::load_or_create(&path).expect("reloaded");
        assert_eq!(a.device_id(), b.device_id(), "the same device across restarts");
        assert_eq!(a.device_id().len(), 64);
        let text = std::fs::read_to_string(&path).expect("file");
        assert!(!format!("{a:?}").contains(&text[text.find("privateKey").unwrap_or(0)..][..20]));
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn signatures_verify_against_the_published_key() {
        let path = tmp();
        let id = DeviceIdentity::load_or_create(&path).expect("created");
        let scopes = vec!["operator.read".to_owned()];
        let p = params(&scopes);
        let proof = id.prove(&p);
        let raw: [u8; 32] = URL_SAFE_NO_PAD.decode(&proof.public_key).expect("b64").try_into().expect("32 bytes");
        assert_eq!(device_id_of(&raw), proof.id);
        let vk = VerifyingKey::from_bytes(&raw).expect("key");
        let sig: [u8; 64] = URL_SAFE_NO_PAD.decode(&proof.signature).expect("b64").try_into().expect("64 bytes");
        vk.verify(payload(&proof.id, &p).as_bytes(), &Signature::from_bytes(&sig)).expect("verifies");
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Found as a flaky test: two starts in one process wrote the same temporary file, and the
    /// loser took the collision for an existing key that it then could not read.
    #[test]
    fn concurrent_creation_in_one_process_yields_one_identity() {
        let path = tmp();
        let ids: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| DeviceIdentity::load_or_create(&path))).collect();
            handles.into_iter().map(|h| h.join().expect("thread").expect("identity").device_id().to_owned()).collect()
        });
        assert!(ids.iter().all(|id| id == &ids[0]), "{ids:?}");
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn corrupt_or_open_files_give_clear_errors() {
        let path = tmp();
        std::fs::create_dir_all(path.parent().expect("dir")).expect("dir");
        std::fs::write(&path, b"not json").expect("write");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        }
        let err = DeviceIdentity::load_or_create(&path).expect_err("corrupt");
        assert!(err.to_string().contains("corrupt") && err.to_string().contains(&path.display().to_string()), "{err}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
            let err = DeviceIdentity::load_or_create(&path).expect_err("too open");
            assert!(err.to_string().contains("chmod 600"), "{err}");
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }
}
