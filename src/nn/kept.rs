//! What a layer's training forward pass keeps for its backward pass besides its input
//! and output: one buffer of values, in the activations workspace (where it lives as
//! long as the step's activations, and a planned arena counts it; with workspaces off,
//! in the activations' heap workspace, alike).

use ndarray::Ix1;
use workspace_core::{ArrayType, Handle, LayerWorkspaceMgr};

use crate::{Error, Result};

use super::layer::ForwardCtx;
use super::vector::zeros_new;

/// A layer's kept values of its last training forward pass, with the fingerprint of
/// the batch they belong to (see [`fingerprint`]).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    values: Values,
    print: u64,
}

#[derive(Debug, Default)]
enum Values {
    #[default]
    Empty,
    /// In the activations workspace, for as long as its cycle lasts.
    Workspace(Handle<f32, Ix1>),
}

impl Kept {
    /// Drops what was kept (an inference pass, or a failed one, leaves nothing).
    pub(crate) fn clear(&mut self) {
        *self = Kept::default();
    }

    /// `len` zeros kept for the backward pass of the batch of fingerprint `print`, and
    /// `f` run on them (to fill them).
    pub(crate) fn fill<R>(
        &mut self,
        len: usize,
        print: u64,
        ctx: &ForwardCtx<'_, '_>,
        f: impl FnOnce(&mut [f32]) -> Result<R>,
    ) -> Result<R> {
        self.clear();
        let mut handle = ctx.activations.handle_with::<f32, _>(len, zeros_new)?;
        let result = {
            let mut view = handle.view_mut(ctx.activations)?;
            f(view.as_slice_mut().expect("a new array is contiguous"))?
        };
        self.values = Values::Workspace(handle);
        self.print = print;
        Ok(result)
    }

    /// Runs `f` on the kept values, checked to be `len` long and of the batch of
    /// fingerprint `print`; `layer` names the layer in an error.
    pub(crate) fn with<R>(
        &self,
        len: usize,
        print: u64,
        mgr: &LayerWorkspaceMgr,
        layer: &str,
        f: impl FnOnce(&[f32]) -> Result<R>,
    ) -> Result<R> {
        match &self.values {
            Values::Empty => Err(Error::InvalidInput(format!(
                "layer '{layer}': a backward pass without a training forward pass before it"
            ))),
            Values::Workspace(handle) => {
                let scope = mgr.borrow_open(ArrayType::Activations)?;
                let view = handle.view(&scope)?;
                self.checked(view.as_slice().expect("a new array is contiguous"), len, print, layer, f)
            }
        }
    }

    fn checked<R>(
        &self,
        values: &[f32],
        len: usize,
        print: u64,
        layer: &str,
        f: impl FnOnce(&[f32]) -> Result<R>,
    ) -> Result<R> {
        if values.len() != len || print != self.print {
            return Err(Error::InvalidInput(format!(
                "layer '{layer}': a backward pass on another batch or mask than its forward pass"
            )));
        }
        f(values)
    }
}

/// A fingerprint of a batch's shape and mask (which steps hold data), or of none: a
/// backward pass checks that it runs on the batch its forward pass kept values of.
pub(crate) fn fingerprint(mask: Option<&ndarray::ArrayView2<'_, f32>>, batch: usize, steps: usize) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64 ^ (batch as u64).wrapping_mul(0x1000_0000_01b3);
    hash = (hash ^ steps as u64).wrapping_mul(0x1000_0000_01b3);
    if let Some(mask) = mask {
        for &m in mask.iter() {
            hash = (hash ^ u64::from(m != 0.0)).wrapping_mul(0x1000_0000_01b3);
        }
    } else {
        hash ^= 0x9e37_79b9_7f4a_7c15;
    }
    hash
}
