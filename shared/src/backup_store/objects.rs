//! The objects of one Backup in a store: creating, committing, reading and removing its
//! artifact and manifest, and the temporary files an interrupted attempt left.

use std::path::PathBuf;

use futures::TryStreamExt;
use object_store::{ObjectStoreExt, PutPayload};

use super::error::StoreError;
use super::s3::s3_error;
use super::sink::{ArtifactReader, ArtifactWriter};
use super::store::{BackupStore, ObjectKey};

impl BackupStore {
    /// The artifact of `key`, a new temporary name for it, its manifest and a new
    /// temporary name for that: each writer has its own temporary file.
    fn paths(
        &self,
        root: &std::path::Path,
        key: &ObjectKey,
    ) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
        let dir = root.join(&key.namespace);
        let writer = rand::random::<u32>();
        (
            dir.join(format!("{}.dump", key.stem)),
            dir.join(format!(".{}.{writer:08x}.dump.partial", key.stem)),
            dir.join(format!("{}.manifest.json", key.stem)),
            dir.join(format!(".{}.{writer:08x}.manifest.json.partial", key.stem)),
        )
    }

    /// The temporary files of `key` that are there now, whoever's: `.<stem>.` names
    /// ending in `.partial` (the older `.<stem>.dump.partial` included).
    async fn partial_files(
        &self,
        root: &std::path::Path,
        key: &ObjectKey,
    ) -> Result<Vec<PathBuf>, StoreError> {
        let dir = root.join(&key.namespace);
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.io(format!("listing {}", dir.display()))(e)),
        };
        let prefix = format!(".{}.", key.stem);
        let mut found = Vec::new();
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(self.io(format!("listing {}", dir.display())))?
        {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(&prefix) && name.ends_with(".partial") {
                found.push(entry.path());
            }
        }
        Ok(found)
    }

    async fn remove_files(&self, paths: Vec<PathBuf>) -> Result<(), StoreError> {
        for path in paths {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.io(format!("removing {}", path.display()))(e)),
            }
        }
        Ok(())
    }

    /// Starts (or starts over) the artifact of `key`: under its temporary name in a
    /// `file://` store; in an `s3://` store nothing is sent before a part is full.
    pub async fn create_artifact(&self, key: &ObjectKey) -> Result<ArtifactWriter, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.artifact())?;
                return Ok(ArtifactWriter::s3(
                    self.to_string(),
                    self.location(key),
                    client,
                    path,
                ));
            }
        };
        let (target, partial, _, _) = self.paths(root, key);
        if let Some(dir) = target.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(self.io(format!("creating {}", dir.display())))?;
        }
        let file = tokio::fs::File::create(&partial)
            .await
            .map_err(self.io(format!("creating {}", partial.display())))?;
        Ok(ArtifactWriter::file(
            self.to_string(),
            partial,
            target,
            file,
        ))
    }

    /// Writes the manifest of `key`: a temporary name renamed into place (`file://`), or
    /// one PUT (`s3://`).
    pub async fn put_manifest(&self, key: &ObjectKey, body: &[u8]) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.manifest())?;
                let location = self.url_of(&key.manifest());
                return client
                    .put(&path, PutPayload::from(body.to_vec()))
                    .await
                    .map(drop)
                    .map_err(|e| {
                        s3_error(&self.to_string(), "writing the manifest", &location, &e)
                    });
            }
        };
        let (_, _, target, partial) = self.paths(root, key);
        let file = tokio::fs::File::create(&partial)
            .await
            .map_err(self.io(format!("creating {}", partial.display())))?;
        self.fill_synced(file, &partial, body).await?;
        tokio::fs::rename(&partial, &target)
            .await
            .map_err(self.io(format!("renaming {}", partial.display())))
    }

    /// Opens the complete artifact of `key` for reading (a restore reads it), streamed:
    /// nothing is read ahead beyond a buffer. A missing artifact is
    /// [`StoreError::NotFound`].
    pub async fn open_artifact(&self, key: &ObjectKey) -> Result<ArtifactReader, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.artifact())?;
                let location = self.location(key);
                let found = client.get(&path).await.map_err(|e| {
                    s3_error(&self.to_string(), "reading the artifact", &location, &e)
                })?;
                let stream = found.into_stream().map_err(std::io::Error::from);
                return Ok(Box::new(tokio_util::io::StreamReader::new(stream)));
            }
        };
        let (target, _, _, _) = self.paths(root, key);
        match tokio::fs::File::open(&target).await {
            Ok(file) => Ok(Box::new(tokio::io::BufReader::with_capacity(1 << 20, file))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::NotFound(self.location(key)))
            }
            Err(e) => Err(self.io(format!("opening {}", target.display()))(e)),
        }
    }

    /// Reads the manifest of `key`. A missing manifest is [`StoreError::NotFound`].
    pub async fn get_manifest(&self, key: &ObjectKey) -> Result<Vec<u8>, StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                let (client, path) = self.s3(&key.manifest())?;
                let location = self.url_of(&key.manifest());
                let error = |e: object_store::Error| {
                    s3_error(&self.to_string(), "reading the manifest", &location, &e)
                };
                let found = client.get(&path).await.map_err(error)?;
                return Ok(found.bytes().await.map_err(error)?.to_vec());
            }
        };
        let (_, _, manifest, _) = self.paths(root, key);
        match tokio::fs::read(&manifest).await {
            Ok(body) => Ok(body),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(StoreError::NotFound(format!("{}", manifest.display())))
            }
            Err(e) => Err(self.io(format!("reading {}", manifest.display()))(e)),
        }
    }

    /// Removes the artifact, its manifest and every partial file of `key`; what is
    /// already gone counts as removed.
    pub async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => {
                for relative in [key.manifest(), key.artifact()] {
                    let (client, path) = self.s3(&relative)?;
                    match client.delete(&path).await {
                        Ok(()) => {}
                        Err(e) => match s3_error(
                            &self.to_string(),
                            "removing an object",
                            &self.url_of(&relative),
                            &e,
                        ) {
                            StoreError::NotFound(_) => {}
                            e => return Err(e),
                        },
                    }
                }
                return Ok(());
            }
        };
        let (artifact, _, manifest, _) = self.paths(root, key);
        self.remove_files(vec![manifest, artifact]).await?;
        let partials = self.partial_files(root, key).await?;
        self.remove_files(partials).await
    }

    /// Removes only the partial files of `key` (after an attempt that gave up, or
    /// completed after an interrupted one). An `s3://` store has none to remove: an
    /// unfinished upload is invisible, aborted when its writer is dropped, and otherwise
    /// expired by the bucket's lifecycle rule.
    pub async fn discard_partial(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let root = match self {
            Self::File { root } => root,
            Self::S3 { .. } => return Ok(()),
        };
        let partials = self.partial_files(root, key).await?;
        self.remove_files(partials).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backup_store::s3::s3_key;

    fn key() -> ObjectKey {
        ObjectKey::new("team-a", "orders-1", "0b5c")
    }

    #[tokio::test]
    async fn an_artifact_appears_only_when_committed_and_a_retry_overwrites() {
        let dir = tempfile::tempdir().unwrap();
        let store = BackupStore::File {
            root: dir.path().into(),
        };
        let artifact = dir.path().join("team-a/orders-1-0b5c.dump");
        let mut first = store.create_artifact(&key()).await.unwrap();
        first.write(b"half of a dump").await.unwrap();
        drop(first); // a crash mid-dump
        assert!(!artifact.exists());

        let mut second = store.create_artifact(&key()).await.unwrap();
        second.write(b"all").await.unwrap();
        second.commit().await.unwrap();
        store.put_manifest(&key(), b"{}").await.unwrap();
        assert_eq!(std::fs::read(&artifact).unwrap(), b"all");
        // Each writer had its own partial file: the crashed one's is still there until
        // the completed attempt discards the leftovers.
        let partials = std::fs::read_dir(dir.path().join("team-a"))
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(".dump.partial")
            })
            .count();
        assert_eq!(partials, 1);
        store.discard_partial(&key()).await.unwrap();
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("team-a"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["orders-1-0b5c.dump", "orders-1-0b5c.manifest.json"]);
        assert_eq!(
            store.location(&key()),
            format!("file://{}", artifact.display())
        );
        let mut read = String::new();
        tokio::io::AsyncReadExt::read_to_string(
            &mut store.open_artifact(&key()).await.unwrap(),
            &mut read,
        )
        .await
        .unwrap();
        assert_eq!(read, "all");

        store.delete(&key()).await.unwrap();
        store.delete(&key()).await.unwrap(); // already gone: still a success
        assert_eq!(
            std::fs::read_dir(dir.path().join("team-a"))
                .unwrap()
                .count(),
            0
        );
    }

    #[tokio::test]
    async fn an_unwritable_store_is_a_transient_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-directory");
        std::fs::write(&file, b"").unwrap();
        let store = BackupStore::File { root: file };
        let e = store.create_artifact(&key()).await.err().unwrap();
        assert!(e.is_transient(), "{e}");
    }

    /// Settings for an S3 endpoint on loopback (never a real one: no test leaves 127/8).
    fn s3_settings(endpoint: &str) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", "test-key".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "test-secret-value".to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
            ("AWS_ENDPOINT_URL", endpoint.to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("HOME", "/nowhere".to_string()),
        ]
    }

    #[test]
    fn s3_objects_sit_under_the_prefix() {
        let store: BackupStore = "s3://backups/dbops/prod/".parse().unwrap();
        assert_eq!(
            store.location(&key()),
            "s3://backups/dbops/prod/team-a/orders-1-0b5c.dump"
        );
        assert_eq!(
            store.url_of(&key().manifest()),
            "s3://backups/dbops/prod/team-a/orders-1-0b5c.manifest.json"
        );
        let bare: BackupStore = "s3://backups".parse().unwrap();
        assert_eq!(
            bare.location(&key()),
            "s3://backups/team-a/orders-1-0b5c.dump"
        );
        assert_eq!(
            s3_key("a//b/", "ns/x.dump").as_ref(),
            "a/b/ns/x.dump",
            "no empty segment"
        );
    }

    #[test]
    fn s3_settings_values_never_show_in_debug_output() {
        let store = "s3://backups/x"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(s3_settings("http://127.0.0.1:1"));
        let shown = format!("{store:?}");
        assert!(shown.contains("AWS_SECRET_ACCESS_KEY"), "{shown}");
        assert!(!shown.contains("test-secret-value"), "{shown}");
        assert!(!shown.contains("test-key\""), "{shown}");
    }

    #[tokio::test]
    async fn an_unreachable_s3_endpoint_is_a_transient_error() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let store = "s3://backups/x"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(s3_settings(&endpoint));
        let e = store.put_manifest(&key(), b"{}").await.unwrap_err();
        assert!(matches!(e, StoreError::Remote { .. }), "{e}");
        assert!(e.is_transient(), "{e}");
        assert!(!e.to_string().contains("test-secret-value"), "{e}");
        // Nothing is sent before a part is full: starting an artifact cannot fail.
        let mut writer = store.create_artifact(&key()).await.unwrap();
        writer.write(b"a small dump").await.unwrap();
        let e = writer.commit().await.unwrap_err();
        assert!(e.is_transient(), "{e}");
    }

    #[tokio::test]
    async fn a_plain_http_endpoint_needs_to_be_allowed() {
        let mut settings = s3_settings("http://127.0.0.1:1");
        settings.retain(|(k, _)| *k != "AWS_ALLOW_HTTP");
        let store = "s3://backups"
            .parse::<BackupStore>()
            .unwrap()
            .with_s3_environment(settings);
        let e = store.get_manifest(&key()).await.unwrap_err();
        assert!(!e.is_transient(), "{e}");
        assert!(e.to_string().contains("AWS_ALLOW_HTTP"), "{e}");
    }
}
