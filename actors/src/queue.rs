//! Per-key FIFO admission: items that share a key run one after another, in arrival order; items
//! with different keys run in parallel. Used for session keys (the gateway would interleave two
//! runs' frames on one session otherwise) and, later, branch keys.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Per-key queues. A key is "busy" from the moment an item is admitted until `finish(key)`.
#[derive(Debug)]
pub struct KeyQueue<K, V> {
    waiting: HashMap<K, VecDeque<V>>,
}

impl<K, V> Default for KeyQueue<K, V> {
    fn default() -> Self {
        Self { waiting: HashMap::new() }
    }
}

impl<K: Eq + Hash + Clone, V> KeyQueue<K, V> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Offers an item. Returns it back when its key is idle (the caller starts it now); otherwise
    /// keeps it queued and returns `None`.
    pub fn admit(&mut self, key: &K, item: V) -> Option<V> {
        match self.waiting.get_mut(key) {
            Some(q) => {
                q.push_back(item);
                None
            }
            None => {
                self.waiting.insert(key.clone(), VecDeque::new());
                Some(item)
            }
        }
    }

    /// Offers an item that goes first: like [`KeyQueue::admit`], but it waits at the FRONT of the
    /// queue (`ifBusy: interrupt`: it runs right after the item it interrupts).
    pub fn admit_front(&mut self, key: &K, item: V) -> Option<V> {
        match self.waiting.get_mut(key) {
            Some(q) => {
                q.push_front(item);
                None
            }
            None => {
                self.waiting.insert(key.clone(), VecDeque::new());
                Some(item)
            }
        }
    }

    /// The running item of `key` finished: returns the next one to start (still holding the key),
    /// or frees the key.
    pub fn finish(&mut self, key: &K) -> Option<V> {
        let q = self.waiting.get_mut(key)?;
        match q.pop_front() {
            Some(next) => Some(next),
            None => {
                self.waiting.remove(key);
                None
            }
        }
    }

    /// Removes a queued (not running) item matching `pred`; returns it.
    pub fn remove_waiting(&mut self, key: &K, pred: impl Fn(&V) -> bool) -> Option<V> {
        let q = self.waiting.get_mut(key)?;
        let pos = q.iter().position(pred)?;
        q.remove(pos)
    }

    /// Number of items waiting behind running ones.
    pub fn waiting_len(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }

    /// True when the key has a running item.
    pub fn is_busy(&self, key: &K) -> bool {
        self.waiting.contains_key(key)
    }

    /// Drains every waiting item (shutdown).
    pub fn drain_waiting(&mut self) -> Vec<V> {
        self.waiting.values_mut().flat_map(|q| q.drain(..)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_runs_in_arrival_order() {
        let mut q = KeyQueue::new();
        assert_eq!(q.admit(&"k", 1), Some(1));
        assert_eq!(q.admit(&"k", 2), None);
        assert_eq!(q.admit(&"k", 3), None);
        assert_eq!(q.admit(&"other", 9), Some(9));
        assert_eq!(q.waiting_len(), 2);
        assert_eq!(q.finish(&"k"), Some(2));
        assert_eq!(q.finish(&"k"), Some(3));
        assert_eq!(q.finish(&"k"), None);
        assert!(!q.is_busy(&"k"));
        assert_eq!(q.admit(&"k", 4), Some(4));
    }

    #[test]
    fn a_front_admission_runs_next() {
        let mut q = KeyQueue::new();
        q.admit(&"k", 1);
        q.admit(&"k", 2);
        assert_eq!(q.admit_front(&"k", 9), None);
        assert_eq!(q.finish(&"k"), Some(9));
        assert_eq!(q.finish(&"k"), Some(2));
        assert_eq!(q.admit_front(&"idle", 5), Some(5));
    }

    #[test]
    fn waiting_items_can_be_removed() {
        let mut q = KeyQueue::new();
        q.admit(&"k", 1);
        q.admit(&"k", 2);
        q.admit(&"k", 3);
        assert_eq!(q.remove_waiting(&"k", |v| *v == 2), Some(2));
        assert_eq!(q.remove_waiting(&"k", |v| *v == 1), None, "the running item is not waiting");
        assert_eq!(q.finish(&"k"), Some(3));
    }
}
