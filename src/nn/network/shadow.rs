//! The shape-only workspaces of a dry run ([`Network::dry_run`]): twins of a network's
//! workspaces as they are when it starts, and the state that tells whether a pass
//! changed them.

use std::rc::Rc;

use workspace_core::{LayerWorkspaceMgr, Sizing, Workspace, WorkspaceManager, WorkspaceMode};

use crate::Result;

use super::config::{inference_mgr_in, training_mgrs_in};
use super::{training_workspaces, Network};

/// The shape-only workspaces of one dry run: twins of the network's workspaces as they
/// are when it starts, and the network's managers over them, with the same names,
/// configurations and modes as the network's (workspaces off: enabled ones, so that
/// the figures of each pass are known all the same).
pub(super) struct Shadow {
    pub(super) train: [LayerWorkspaceMgr; 2],
    pub(super) infer: LayerWorkspaceMgr,
    /// The workspaces a training step (`[0]`) and an inference (`[1]`) allocate in.
    of_kind: [Vec<Rc<Workspace>>; 2],
    /// Every workspace, each once (plan groups' members included).
    pub(super) all: Vec<Rc<Workspace>>,
}

impl Shadow {
    /// The shadow of `net`'s workspaces now. Enabled workspaces are the thread's, by
    /// name: other networks of the thread, and this one's earlier passes, have taught
    /// them already, and the real passes go on from there; so each shadow workspace is a
    /// twin of the real one ([`WorkspaceManager::twin`]), and a planned manager's group
    /// a twin of the network's, with the plans it made
    /// ([`PlanGroup::shape_only_twin`](workspace_core::planned::PlanGroup::shape_only_twin)).
    /// Training and inference share workspaces by name, as on the network's thread; a
    /// mode that has no workspaces gets its figures from new workspaces of its own,
    /// which the other mode's do not see.
    pub(super) fn of(net: &Network) -> Result<Shadow> {
        let twins = WorkspaceManager::shape_only();
        for mgr in net.train.iter().chain(std::iter::once(&net.infer)) {
            // A planned manager's workspaces are its group's, not the thread's.
            if mgr.plan_group().is_none() {
                for ws in mgr.workspaces() {
                    twins.twin(ws)?;
                }
            }
        }
        let registry = |mode| match mode {
            WorkspaceMode::None => WorkspaceManager::shape_only(),
            _ => twins.clone(),
        };
        let on = |mode| if mode == WorkspaceMode::None { WorkspaceMode::Enabled } else { mode };
        let (training, inference) = (net.training_mode, net.inference_mode);
        let group = |mgr: &LayerWorkspaceMgr| mgr.plan_group().map(|g| g.shape_only_twin()).transpose();
        let train = training_mgrs_in(on(training), net.learning, Some(&registry(training)), group(&net.train[0])?)?;
        let infer = inference_mgr_in(on(inference), net.learning, Some(&registry(inference)), group(&net.infer)?)?;
        let of_kind: [Vec<Rc<Workspace>>; 2] =
            [training_workspaces(&train).cloned().collect(), infer.workspaces().cloned().collect()];
        let mut all: Vec<Rc<Workspace>> = Vec::new();
        for ws in of_kind.iter().flatten() {
            if !all.iter().any(|w| w.id() == ws.id()) {
                all.push(ws.clone());
            }
        }
        Ok(Shadow { train, infer, of_kind, all })
    }

    /// The manager a pass of `kind` (`DryPass::kind`) runs in.
    pub(super) fn mgr(&self, kind: usize) -> &LayerWorkspaceMgr {
        match kind {
            0 => &self.train[0],
            _ => &self.infer,
        }
    }

    /// The workspaces a pass of `kind` allocates in: a training step's (the training
    /// workspaces), an inference's.
    pub(super) fn workspaces_of(&self, kind: usize) -> &[Rc<Workspace>] {
        &self.of_kind[kind.min(1)]
    }

    /// What decides every later pass's arenas and figures: each workspace's sizing, and
    /// each plan group's arena and plans (see [`ShadowState`]).
    pub(super) fn state(&self) -> ShadowState {
        let groups = [self.train[0].plan_group(), self.infer.plan_group()].map(|group| group.map(|g| g.stats()));
        ShadowState {
            grown: (
                self.all.iter().map(|ws| ws.sizing()).collect(),
                groups.clone().map(|s| s.map(|s| [s.arena_bytes as u64, s.plans, s.recorded_iterations])),
            ),
            spoilt: groups.map(|s| {
                s.map(|s| [s.divergences, s.evictions, s.blocked_iterations, s.failed_growths, s.abandoned_iterations])
            }),
        }
    }
}

/// The shadow's state ([`Shadow::state`]), in two parts. `grown` only ever grows: arenas
/// grow and never shrink (nothing trims them), learning only ends, plans are only added.
/// A pass that found the workspaces in some state and left them so fit in them, learned
/// nothing and replayed its plan: it does so again, to the byte, in any state grown from
/// that one. `spoilt` counts what could undo that: a plan left stale by a divergence, or
/// dropped from the cache, or not reached.
#[derive(PartialEq)]
pub(super) struct ShadowState {
    pub(super) grown: GrownState,
    pub(super) spoilt: [Option<[u64; 5]>; 2],
}

/// Each workspace's sizing; each plan group's arena, plans made and recordings.
pub(super) type GrownState = (Vec<Sizing>, [Option<[u64; 3]>; 2]);
