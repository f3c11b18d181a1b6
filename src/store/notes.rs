//! Ends the store could not record: a file of its own next to the store (`runs.db-ends`).
//!
//! When the store cannot take a run's writes (a full disk), the run ends `internal` at once (its
//! clients must not hang) and that end is written to the store as soon as it takes writes again.
//! If clawmux stops before that, the store still holds the run as unfinished, and the next start
//! would continue it: a client that saw `internal` could then see a second, different terminal
//! event. So the end is noted here first, and the next start ends noted runs `internal` instead
//! of continuing them.
//!
//! A full disk must not stop the note either: the file is filled with zeros when it is opened, and
//! a note overwrites zeros in place (no new block is needed, on any file system that overwrites in
//! place). Notes are lines `<runId> <eventId> <seq>\n` (`seq`: the run's admission number, so a
//! note is never applied to a later run that reuses the id after the noted one was swept; notes
//! of earlier versions have no `seq`); the rest of the file is zeros. No fsync: the
//! note has to survive clawmux (a crash, `kill -9`), not the machine (the store's own last commits
//! before a power loss are not durable either, `synchronous = NORMAL`).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The file's size: ~5,000 notes of UUID run ids (a full disk ends every live run at once, and
/// `CLAWMUX_MAX_RUNS` is 5,000 by default).
pub const SIZE: u64 = 256 * 1024;

/// The notes file.
pub struct EndNotes {
    /// The file (for messages).
    path: PathBuf,
    /// The open file and where the next note goes.
    file: Mutex<(File, u64)>,
}

/// One note: the run, the id of the end its clients saw, and the run's admission number (`None`
/// in a note of an earlier version).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// The run.
    pub run_id: String,
    /// Its end's event id.
    pub event_id: u64,
    /// Its admission number: the note is this run's, not a later one's under the same id.
    pub seq: Option<i64>,
}

/// The notes in `bytes` and the offset after the last one. A line that is not a note (the file is
/// input too) is skipped.
pub fn parse(bytes: &[u8]) -> (Vec<Note>, u64) {
    let used = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    let notes = bytes[..used]
        .split(|b| *b == b'\n')
        .filter_map(|line| {
            let mut fields = std::str::from_utf8(line).ok()?.split(' ');
            let run_id = fields.next()?;
            let event_id = fields.next()?.parse::<u64>().ok()?;
            let seq = match fields.next() {
                Some(s) => Some(s.parse::<i64>().ok()?),
                None => None,
            };
            let whole = fields.next().is_none() && crate::request::is_valid_id(run_id);
            whole.then(|| Note { run_id: run_id.to_owned(), event_id, seq })
        })
        .collect();
    (notes, used as u64)
}

/// The line of one note, if the run id can be written as one (it is validated at admission).
pub fn line(run_id: &str, event_id: u64, seq: i64) -> Option<String> {
    crate::request::is_valid_id(run_id).then(|| format!("{run_id} {event_id} {seq}\n"))
}

impl EndNotes {
    /// The notes of the store at `store` (`<store>-ends`), created and filled with zeros up to
    /// [`SIZE`] if needed. Nothing already noted is changed.
    pub fn open(store: &Path) -> Result<Self, String> {
        let mut path = store.as_os_str().to_owned();
        path.push("-ends");
        let path = PathBuf::from(path);
        let fail = |e: std::io::Error| format!("the run store's end notes {} cannot be opened: {e}", path.display());
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(fail)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(fail)?;
        let (_, cursor) = parse(&bytes);
        let len = bytes.len() as u64;
        if len < SIZE {
            // Real zeros, not a hole: a note must never need a new block.
            let zeros = vec![0u8; usize::try_from(SIZE - len).unwrap_or(0)];
            file.write_all_at(&zeros, len).map_err(fail)?;
        }
        Ok(Self { path, file: Mutex::new((file, cursor)) })
    }

    fn lock(&self) -> MutexGuard<'_, (File, u64)> {
        self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes that `run_id` (admitted as `seq`) ended with event `event_id` and the store does not
    /// have it.
    pub fn note(&self, run_id: &str, event_id: u64, seq: i64) -> Result<(), String> {
        let line = line(run_id, event_id, seq).ok_or_else(|| format!("run id {run_id:?} cannot be noted"))?;
        let mut g = self.lock();
        let (file, cursor) = &mut *g;
        let end = *cursor + line.len() as u64;
        if end > SIZE {
            return Err(format!("the run store's end notes {} are full", self.path.display()));
        }
        file.write_all_at(line.as_bytes(), *cursor).map_err(|e| format!("the run store's end notes {}: {e}", self.path.display()))?;
        *cursor = end;
        Ok(())
    }

    /// Every note, in order.
    pub fn read(&self) -> Result<Vec<Note>, String> {
        let g = self.lock();
        let mut bytes = vec![0u8; usize::try_from(g.1).unwrap_or(0)];
        g.0.read_exact_at(&mut bytes, 0).map_err(|e| format!("the run store's end notes {}: {e}", self.path.display()))?;
        Ok(parse(&bytes).0)
    }

    /// Forgets every note (zeros over them: the file keeps its blocks).
    pub fn clear(&self) -> Result<(), String> {
        let mut g = self.lock();
        let (file, cursor) = &mut *g;
        let zeros = vec![0u8; usize::try_from(*cursor).unwrap_or(0)];
        file.write_all_at(&zeros, 0).map_err(|e| format!("the run store's end notes {}: {e}", self.path.display()))?;
        *cursor = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The file is input: any bytes parse without a panic, and a note written among any other
        /// lines (of either format, or garbage) reads back exactly, where it was.
        #[test]
        fn any_file_parses_and_a_written_note_reads_back(
            before in proptest::collection::vec(any::<u8>(), 0..200),
            after in proptest::collection::vec(any::<u8>(), 0..200),
            run_id in "[A-Za-z0-9._:-]{1,128}",
            event_id in any::<u64>(),
            seq in any::<i64>(),
        ) {
            let _ = parse(&before);
            // Lines around it: no zero (the file's end) and whole lines.
            let clean = |b: &[u8]| { let mut v: Vec<u8> = b.iter().copied().filter(|c| *c != 0).collect(); v.push(b'\n'); v };
            let mut bytes = clean(&before);
            let ours = line(&run_id, event_id, seq).expect("a valid id");
            bytes.extend_from_slice(ours.as_bytes());
            bytes.extend_from_slice(&clean(&after));
            let (notes, cursor) = parse(&bytes);
            prop_assert_eq!(cursor, bytes.len() as u64);
            let note = Note { run_id: run_id.clone(), event_id, seq: Some(seq) };
            prop_assert!(notes.contains(&note), "{:?} not among {:?}", note, notes);
        }
    }

    #[test]
    fn parses_notes_and_skips_what_is_not_one() {
        let mut bytes = b"run-1 7\nbad line\nrun 2 3 4\n\xff\xfe 4\nrun-3 x\nrun-4 12 5\nrun-5 1 x\nrun-6 1 2 3\n".to_vec();
        let used = bytes.len() as u64;
        bytes.extend_from_slice(&[0; 64]);
        let (notes, cursor) = parse(&bytes);
        let note = |run: &str, event_id, seq| Note { run_id: run.to_owned(), event_id, seq };
        assert_eq!(notes, [note("run-1", 7, None), note("run-4", 12, Some(5))]);
        assert_eq!(cursor, used);
        assert_eq!(parse(&[0; 16]), (Vec::new(), 0));
        assert_eq!(line("a b", 1, 1), None);
        assert_eq!(line("a\nb", 1, 1), None);
    }

    #[test]
    fn notes_survive_a_reopen_until_cleared_and_the_file_keeps_its_size() {
        let dir = tempfile::tempdir().expect("dir");
        let store = dir.path().join("runs.db");
        let notes = EndNotes::open(&store).expect("open");
        let file = dir.path().join("runs.db-ends");
        assert_eq!(std::fs::metadata(&file).expect("file").len(), SIZE);
        notes.note("run-a", 5, 1).expect("note");
        notes.note("run-b", 9, 2).expect("note");
        drop(notes);
        let notes = EndNotes::open(&store).expect("reopen");
        notes.note("run-c", 1, 3).expect("note after reopen");
        let ids: Vec<(String, u64, Option<i64>)> = notes.read().expect("read").into_iter().map(|n| (n.run_id, n.event_id, n.seq)).collect();
        assert_eq!(ids, [("run-a".to_owned(), 5, Some(1)), ("run-b".to_owned(), 9, Some(2)), ("run-c".to_owned(), 1, Some(3))]);
        notes.clear().expect("clear");
        assert_eq!(notes.read().expect("read"), []);
        assert_eq!(EndNotes::open(&store).expect("reopen").read().expect("read"), []);
        assert_eq!(std::fs::metadata(&file).expect("file").len(), SIZE);
    }

    #[test]
    fn a_full_file_refuses_the_note_and_keeps_the_others() {
        let dir = tempfile::tempdir().expect("dir");
        let notes = EndNotes::open(&dir.path().join("runs.db")).expect("open");
        let id = "r".repeat(120);
        let per = line(&id, 1, 1).expect("line").len() as u64;
        for _ in 0..SIZE / per {
            notes.note(&id, 1, 1).expect("room");
        }
        assert!(notes.note(&id, 1, 1).is_err_and(|e| e.contains("full")));
        assert_eq!(notes.read().expect("read").len() as u64, SIZE / per);
    }
}
