//! What a store is, whatever URL or mount reaches it: the [`StoreIdentity`] kept in the
//! store itself, created by the first process that asks; and the probe that this process
//! can write to a `file://` store.

use std::fmt;
use std::sync::Arc;

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tokio::io::AsyncWriteExt;

use super::error::StoreError;
use super::s3::s3_error;
use super::store::BackupStore;

/// The object at a store's root that names the store: [`BackupStore::identity`].
pub const IDENTITY_OBJECT: &str = ".dbops-store-id";

/// What a store is, whatever URL or mount reaches it: a random id kept in the store
/// itself ([`IDENTITY_OBJECT`]), written by the first process that asks for it. Two
/// processes see the same artifacts exactly when they read the same identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreIdentity(String);

impl StoreIdentity {
    /// A new identity: 32 random hex digits.
    fn random() -> Self {
        Self(format!("{:032x}", rand::random::<u128>()))
    }

    /// An identity read back from a store or a registration: one short line of letters,
    /// digits, `-` and `_` (what [`StoreIdentity::random`] writes, or what an operator
    /// wrote by hand); anything else is not an identity.
    pub fn parse(text: &str) -> Option<Self> {
        let id = text.trim();
        let valid = !id.is_empty()
            && id.len() <= 128
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        valid.then(|| Self(id.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StoreIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl BackupStore {
    /// The store's identity: read from [`IDENTITY_OBJECT`] at its root (`file://`:
    /// `<root>/.dbops-store-id`; `s3://`: `<prefix>/.dbops-store-id`), or created with a
    /// random id when absent. Processes racing to create it agree on one id: a `file://`
    /// store writes a temporary file and hard-links it into place, which fails when the
    /// name exists (a file system without hard links gets an exclusive create); an
    /// `s3://` store puts with `If-None-Match: *`; the loser reads the winner's id.
    pub async fn identity(&self) -> Result<StoreIdentity, StoreError> {
        match self {
            Self::File { root } => self.file_identity(root).await,
            Self::S3 { .. } => self.s3_identity().await,
        }
    }

    /// Checks that this process can write to a `file://` store: creates its root when
    /// missing, then creates, syncs and removes `.dbops-probe-<random>` in it. The error
    /// names the path and the OS error (permission denied, read-only file system, not a
    /// directory, ...). An `s3://` store is not probed (nothing is written).
    pub async fn probe_writable(&self) -> Result<(), StoreError> {
        let Self::File { root } = self else {
            return Ok(());
        };
        tokio::fs::create_dir_all(root)
            .await
            .map_err(self.io(format!("creating the directory {}", root.display())))?;
        // First an unnamed file (O_TMPFILE): written and synced like an artifact, and gone
        // with its descriptor, so a process killed mid-probe leaves nothing in the store.
        // A filesystem without O_TMPFILE (NFS, for one) gets a named probe file.
        let unnamed = {
            let mut options = tokio::fs::OpenOptions::new();
            options
                .write(true)
                .mode(0o600)
                .custom_flags(libc::O_TMPFILE);
            options.open(root).await
        };
        match unnamed {
            Ok(mut file) => {
                let what = format!("writing an unnamed probe file in {}", root.display());
                file.write_all(b"dbops write probe\n")
                    .await
                    .map_err(self.io(what.clone()))?;
                return file.sync_all().await.map_err(self.io(what));
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) => {}
            Err(e) => {
                return Err(self.io(format!(
                    "creating an unnamed probe file in {}",
                    root.display()
                ))(e));
            }
        }
        let probe = root.join(format!(".dbops-probe-{:016x}", rand::random::<u64>()));
        let written = self.write_synced(&probe, b"dbops write probe\n").await;
        let removed = tokio::fs::remove_file(&probe).await;
        written?;
        match removed {
            Ok(()) => Ok(()),
            // Created, so it exists: a failing removal is worth knowing.
            Err(e) => Err(self.io(format!("removing {}", probe.display()))(e)),
        }
    }

    async fn file_identity(&self, root: &std::path::Path) -> Result<StoreIdentity, StoreError> {
        let target = root.join(IDENTITY_OBJECT);
        if let Some(found) = self.read_file_identity(&target).await? {
            return Ok(found);
        }
        tokio::fs::create_dir_all(root)
            .await
            .map_err(self.io(format!("creating the directory {}", root.display())))?;
        let fresh = StoreIdentity::random();
        let temporary = root.join(format!(
            "{IDENTITY_OBJECT}.{:016x}.partial",
            rand::random::<u64>()
        ));
        let written = self
            .write_synced(&temporary, format!("{fresh}\n").as_bytes())
            .await;
        let linked = match written {
            Ok(()) => tokio::fs::hard_link(&temporary, &target).await,
            Err(e) => {
                let _ = tokio::fs::remove_file(&temporary).await;
                return Err(e);
            }
        };
        let _ = tokio::fs::remove_file(&temporary).await;
        match linked {
            Ok(()) => {
                // Best effort: the new name survives a crash of the machine.
                if let Ok(dir) = tokio::fs::File::open(root).await {
                    let _ = dir.sync_all().await;
                }
                return Ok(fresh);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            // No hard links here (some FUSE and SMB file systems): an exclusive create.
            Err(e) if matches!(e.raw_os_error(), Some(1 | 95)) => {
                if self.create_new_identity(&target, &fresh).await? {
                    return Ok(fresh);
                }
            }
            Err(e) => return Err(self.io(format!("creating {}", target.display()))(e)),
        }
        // Another process created it first: its id is the store's.
        match self.read_file_identity(&target).await? {
            Some(found) => Ok(found),
            None => Err(StoreError::Io {
                store: self.to_string(),
                what: format!("reading {}", target.display()),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "created by another process, then removed",
                ),
            }),
        }
    }

    /// The id in `target`; `None` when the file does not exist.
    async fn read_file_identity(
        &self,
        target: &std::path::Path,
    ) -> Result<Option<StoreIdentity>, StoreError> {
        match tokio::fs::read_to_string(target).await {
            Ok(text) => match StoreIdentity::parse(&text) {
                Some(id) => Ok(Some(id)),
                None => Err(self.not_an_identity(&target.display().to_string())),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io(format!("reading {}", target.display()))(e)),
        }
    }

    /// Writes `body` to a new file `path`, synced.
    async fn write_synced(&self, path: &std::path::Path, body: &[u8]) -> Result<(), StoreError> {
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .await
            .map_err(self.io(format!("creating {}", path.display())))?;
        self.fill_synced(file, path, body).await
    }

    /// Writes `body` to `file`, just opened at `path`, and syncs it.
    pub(super) async fn fill_synced(
        &self,
        mut file: tokio::fs::File,
        path: &std::path::Path,
        body: &[u8],
    ) -> Result<(), StoreError> {
        file.write_all(body)
            .await
            .map_err(self.io(format!("writing {}", path.display())))?;
        file.sync_all()
            .await
            .map_err(self.io(format!("syncing {}", path.display())))
    }

    /// `target` created exclusively with `id`; `false` when it already existed.
    async fn create_new_identity(
        &self,
        target: &std::path::Path,
        id: &StoreIdentity,
    ) -> Result<bool, StoreError> {
        match self
            .write_synced(target, format!("{id}\n").as_bytes())
            .await
        {
            Ok(()) => Ok(true),
            Err(StoreError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn not_an_identity(&self, location: &str) -> StoreError {
        StoreError::Misconfigured {
            store: self.to_string(),
            message: format!(
                "{location} does not hold a store identity (one line of letters, digits, \
                 '-' or '_'); remove it and a new identity is written"
            ),
        }
    }

    async fn s3_identity(&self) -> Result<StoreIdentity, StoreError> {
        let (client, path) = self.s3(IDENTITY_OBJECT)?;
        let location = self.url_of(IDENTITY_OBJECT);
        if let Some(found) = self.get_s3_identity(&client, &path, &location).await? {
            return Ok(found);
        }
        let fresh = StoreIdentity::random();
        let body = PutPayload::from(format!("{fresh}\n").into_bytes());
        let created = client
            .put_opts(&path, body, object_store::PutMode::Create.into())
            .await;
        match created {
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => {}
            Err(e) => {
                return Err(s3_error(
                    &self.to_string(),
                    "writing the store identity",
                    &location,
                    &e,
                ));
            }
        }
        // What is there now, whoever put it (a server that ignores If-None-Match lets the
        // last writer win: reading back still makes this process use the stored id).
        match self.get_s3_identity(&client, &path, &location).await? {
            Some(found) => Ok(found),
            None => Err(StoreError::NotFound(location)),
        }
    }

    async fn get_s3_identity(
        &self,
        client: &Arc<dyn ObjectStore>,
        path: &ObjectPath,
        location: &str,
    ) -> Result<Option<StoreIdentity>, StoreError> {
        let error = |e: object_store::Error| {
            s3_error(
                &self.to_string(),
                "reading the store identity",
                location,
                &e,
            )
        };
        let found = match client.get(path).await {
            Ok(found) => found,
            Err(e) => {
                return match error(e) {
                    StoreError::NotFound(_) => Ok(None),
                    e => Err(e),
                };
            }
        };
        let bytes = found.bytes().await.map_err(error)?;
        match std::str::from_utf8(&bytes)
            .ok()
            .and_then(StoreIdentity::parse)
        {
            Some(id) => Ok(Some(id)),
            None => Err(self.not_an_identity(location)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn processes_racing_on_one_store_agree_on_its_identity() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("store");
            let racers: Vec<_> = (0..8)
                .map(|_| {
                    let store = BackupStore::File { root: root.clone() };
                    tokio::spawn(async move { store.identity().await })
                })
                .collect();
            let mut ids = Vec::new();
            for racer in racers {
                ids.push(racer.await.unwrap().unwrap());
            }
            assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
            let id = &ids[0];
            assert_eq!(id.as_str().len(), 32);
            assert!(id.as_str().chars().all(|c| c.is_ascii_hexdigit()), "{id}");
            let kept = std::fs::read_to_string(root.join(IDENTITY_OBJECT)).unwrap();
            assert_eq!(kept.trim(), id.as_str());
            // Asked again, the store answers the same; no temporary file is left.
            let again = BackupStore::File { root: root.clone() };
            assert_eq!(&again.identity().await.unwrap(), id);
            let names: Vec<_> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            assert_eq!(names, [IDENTITY_OBJECT]);
        }
    }

    #[tokio::test]
    async fn another_root_is_another_store() {
        let dir = tempfile::tempdir().unwrap();
        let first = BackupStore::File {
            root: dir.path().join("a"),
        };
        let second = BackupStore::File {
            root: dir.path().join("b"),
        };
        assert_ne!(
            first.identity().await.unwrap(),
            second.identity().await.unwrap()
        );
    }

    #[tokio::test]
    async fn an_identity_file_that_is_not_one_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(IDENTITY_OBJECT), "").unwrap();
        let store = BackupStore::File {
            root: dir.path().into(),
        };
        let e = store.identity().await.unwrap_err();
        assert!(e.to_string().contains(".dbops-store-id"), "{e}");
        assert!(e.to_string().contains("remove it"), "{e}");
        assert_eq!(
            StoreIdentity::parse(" 0f3a-x_9\n").map(|id| id.to_string()),
            Some("0f3a-x_9".to_owned())
        );
        assert_eq!(StoreIdentity::parse("two words"), None);
    }

    #[tokio::test]
    async fn the_write_probe_creates_the_root_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("new/store");
        let store = BackupStore::File { root: root.clone() };
        store.probe_writable().await.unwrap();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn the_write_probe_names_the_path_and_the_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let root = file.join("store");
        let store = BackupStore::File { root: root.clone() };
        let e = store.probe_writable().await.unwrap_err().to_string();
        assert!(e.contains(&root.display().to_string()), "{e}");
        assert!(e.contains("Not a directory"), "{e}");
        // The identity needs the same directory: no id is invented for it.
        assert!(store.identity().await.is_err());
    }
}
