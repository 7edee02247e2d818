//! What a compile in flight is doing, for a progress line that another thread draws (the
//! Python front's `progress`): the stage, and how many of its parts are done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Progress {
    stage: Mutex<String>,
    done: AtomicUsize,
    total: AtomicUsize,
}

impl Progress {
    /// Enters stage `name` of `total` parts (0: not counted).
    pub fn stage(&self, name: &str, total: usize) {
        let mut s = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        name.clone_into(&mut s);
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }

    pub fn advance(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    /// (stage, parts done, parts in all).
    pub fn snapshot(&self) -> (String, usize, usize) {
        let s = self.stage.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (s, self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }
}
