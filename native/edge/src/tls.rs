//! TLS for the native edge (`--tls-cert`/`--tls-key`): rustls with ring as its crypto provider, ALPN h2.
//!
//! The certificate follows its files the way the grpcio edge's does (`protocol/server.py`, `CertificateFiles`):
//! at every handshake the two files are stat'ed (following the kubelet's `..data` symlinks); once they changed
//! and load together (a certificate chain and the key that matches it) new connections get the new pair; a
//! pair that does not load leaves the served one in place, is not tried again until the files change once more,
//! and is logged once, not at every handshake. The log lines go to Python through the event queue (`Log`).

use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// What identifies the files' contents without reading them: inode, mtime and size of each.
type Stamp = [i64; 6];

/// A line for the broker's log: (warning?, text).
pub type Note = Box<dyn Fn(bool, String) + Send + Sync>;

struct State {
    served: Arc<CertifiedKey>,
    stamp: Option<Stamp>,   // of the pair served
    refused: Option<Stamp>, // of a pair that did not load: not tried again
    complaint: String,      // the last warning, not repeated at every handshake
}

pub struct Certificates {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    state: Mutex<State>,
    note: Note,
}

impl fmt::Debug for Certificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Certificates({})", self.cert.display())
    }
}

fn stamp_of(cert: &Path, key: &Path) -> std::io::Result<Stamp> {
    let (c, k) = (std::fs::metadata(cert)?, std::fs::metadata(key)?);
    Ok([c.ino() as i64, c.mtime() * 1_000_000_000 + c.mtime_nsec(), c.size() as i64,
        k.ino() as i64, k.mtime() * 1_000_000_000 + k.mtime_nsec(), k.size() as i64])
}

/// The pair as it is now, or why not (unreadable, not PEM, no certificate, a key of another certificate).
fn load(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    CertifiedKey::from_der(chain, private, provider).map_err(|e| format!("{}: {e}", key.display()))
}

impl Certificates {
    /// Loads the pair now: an error here refuses the start, as grpcio's edge does.
    pub fn open(cert: PathBuf, key: PathBuf, note: Note) -> Result<Arc<Self>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let stamp = stamp_of(&cert, &key).map_err(|e| format!("{}: {e}", cert.display()))?;
        let served = Arc::new(load(&cert, &key, &provider)?);
        let state = State { served, stamp: Some(stamp), refused: None, complaint: String::new() };
        Ok(Arc::new(Certificates { cert, key, provider, state: Mutex::new(state), note }))
    }

    /// The server side's TLS settings, ALPN h2 (gRPC); TLS 1.2 and 1.3.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, String> {
        let mut config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// At a handshake: the pair in the files when they changed and load, else the one served.
    fn current(&self) -> Arc<CertifiedKey> {
        let mut state = self.state.lock().unwrap();
        let stamp = stamp_of(&self.cert, &self.key).ok();
        if stamp.is_some() && (stamp == state.stamp || stamp == state.refused) {
            return state.served.clone();
        }
        let loaded = match stamp {
            Some(_) => load(&self.cert, &self.key, &self.provider),
            None => Err(format!("{}: cannot stat the pair", self.cert.display())),
        };
        match loaded {
            Ok(pair) => {
                state.served = Arc::new(pair);
                state.stamp = stamp;
                state.complaint.clear();
                (self.note)(false, format!("TLS certificate {} changed: new connections get the new one", self.cert.display()));
            }
            Err(why) => {
                state.refused = stamp;
                if why != state.complaint {
                    let text = format!("TLS certificate {} not reloaded, the one served stays: {why}", self.cert.display());
                    state.complaint = why;
                    (self.note)(true, text);
                }
            }
        }
        state.served.clone()
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}
