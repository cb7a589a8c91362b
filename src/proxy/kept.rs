//! What a proxy keeps on disk between runs (its last table or rules, the DNS cache): JSON
//! written to a temporary file and renamed over the old one, so that a reader never sees a
//! torn file.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Writes `value` to `path` (through `<path>.tmp`, then a rename).
pub fn write<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// What `path` holds: the default when there is no such file, an error naming the file when
/// it cannot be read or is not what it should be.
pub fn read<T: DeserializeOwned + Default>(path: &Path) -> Result<T, String> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_value_reads_back_and_a_bad_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rules.json");
        assert_eq!(read::<Vec<u32>>(&path), Ok(vec![]), "no file: the default");
        write(&path, &vec![1u32, 2]).unwrap();
        assert_eq!(read::<Vec<u32>>(&path), Ok(vec![1, 2]));
        assert!(!dir.path().join("rules.json.tmp").exists());
        std::fs::write(&path, b"{torn").unwrap();
        let err = read::<Vec<u32>>(&path).unwrap_err();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
    }
}
