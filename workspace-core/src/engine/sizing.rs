//! What decides a workspace's arena from here on ([`Sizing`]): read from one workspace
//! and given to another of the same configuration, so that the second sizes its arena
//! exactly as the first would (a dry run's shape-only twin of a workspace that other
//! code has already taught).

use super::Engine;
use crate::backend::ArenaBackend;
use crate::error::Result;

/// The state that decides how a workspace sizes its arena from now on: its arena, and
/// where its learning is. Two workspaces of one configuration with equal sizing end
/// every cycle with the same arena and report the same figures for it, wherever their
/// memory comes from (a shape-only workspace's or RAM's). Counters (cycles,
/// generations, peaks) are not part of it: they change with every cycle and decide
/// nothing.
///
/// ```
/// use workspace_core::{Workspace, WorkspaceConfig, WorkspaceManager};
///
/// let ws = Workspace::new("LEARNED", WorkspaceConfig::default())?;
/// {
///     let scope = ws.enter()?;
///     scope.zeros::<f32, _>(1000)?;
/// }
/// let before = ws.sizing();
/// assert_eq!(before.capacity, ws.capacity());
/// // The twin of a shape-only registry starts where `ws` is.
/// let twin = WorkspaceManager::shape_only().twin(&ws)?;
/// assert_eq!(twin.sizing(), before);
/// # Ok::<(), workspace_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sizing {
    /// The arena's bytes.
    pub capacity: usize,
    /// Cycles that allocate still to watch before the size is learned (0: learned, or
    /// no learning).
    pub learning_cycles_left: u32,
    /// The largest cycle seen while learning.
    pub largest_learning_cycle: usize,
    /// The size learned (or grown to since), once learning is complete.
    pub learned_size: Option<usize>,
    /// After a `trim` without learning: the arena size the next enter restores (0:
    /// none).
    pub restore_to: usize,
}

impl<B: ArenaBackend> Engine<B> {
    /// What decides the arena from now on (see [`Sizing`]).
    pub fn sizing(&self) -> Sizing {
        Sizing {
            capacity: self.capacity.get(),
            learning_cycles_left: self.learning.left.get(),
            largest_learning_cycle: self.learning.max.get(),
            learned_size: self.learning.learned.get(),
            restore_to: self.learning.restore_to.get(),
        }
    }

    /// Takes `sizing` (read from a workspace of this one's configuration) as its own:
    /// the arena is replaced by one of its capacity, and learning goes on from where it
    /// says. Only while closed.
    ///
    /// # Errors
    ///
    /// [`Error::StillOpen`](crate::Error::StillOpen) while a scope is open;
    /// [`Error::Backend`](crate::Error::Backend) when the arena cannot be had.
    pub(crate) fn adopt_sizing(&self, sizing: Sizing) -> Result<()> {
        self.require_closed("taking another workspace's sizing")?;
        // The spills of the last cycle went at its end; a reservation with them.
        self.release_spills();
        if sizing.capacity != self.capacity.get() {
            match sizing.capacity {
                0 => {
                    if let Some(old) = self.arena.borrow_mut().take() {
                        self.backend.borrow_mut().release(old);
                    }
                    self.arena_base.set(None);
                    self.capacity.set(0);
                    self.rewind();
                }
                bytes => self.replace_arena(bytes).map_err(|source| self.backend_error(source))?,
            }
        }
        self.learning.left.set(sizing.learning_cycles_left);
        self.learning.max.set(sizing.largest_learning_cycle);
        self.learning.learned.set(sizing.learned_size);
        self.learning.restore_to.set(sizing.restore_to);
        if sizing.restore_to > 0 {
            self.attention.set(true);
        }
        self.refresh_plain_close();
        Ok(())
    }
}
