//! Who reads what, on every node, computed: the job's whole order (every rank's share of each
//! epoch) from the same sampler, seed and world size each node predicts its own stream with.
//! Node `i` of `N` serves ranks `i*W/N .. (i+1)*W/N` (how launchers number ranks: a node's
//! local ranks are consecutive), so the node that read file f in epoch e, and still holds it,
//! is known to every node without a message.
//!
//! The whole order comes from the sampler ([`Placement`]: flags, or `--sampler auto`), or as the
//! job's hook announced it (a hooked DistributedSampler's epoch, [`crate::plan::World`]): both
//! are split over the nodes the same way ([`Split`]).

use std::sync::Arc;

use crate::catalog::{FileId, MaybeFile};
use crate::order::SamplerKind;
use crate::plan::Order;

/// "Read by no node this epoch".
const NOBODY: u16 = u16::MAX;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlacementError {
    #[error(
        "peers need --sampler torch-distributed (each node reads its own share); this mount's order is another"
    )]
    NotDistributed,
    #[error(
        "peers need a world size that is a multiple of the number of nodes (world {world}, {nodes} nodes in --peers)"
    )]
    World { world: u32, nodes: usize },
    #[error(
        "node {node} of {nodes} serves ranks {first}..={last} (consecutive ranks per node), not {ranks:?}"
    )]
    Ranks {
        node: usize,
        nodes: usize,
        first: u32,
        last: u32,
        ranks: Vec<u32>,
    },
}

/// How a world of ranks is spread over the job's nodes, as seen from one of them.
#[derive(Debug)]
pub struct Split {
    node: usize,
    world_size: u32,
    ranks_per_node: u32,
}

/// A computed order's placement: the whole order, and its split over the nodes.
pub struct Placement {
    /// The job's order with every rank: its stream is the whole world's, rank `p % W` at `p`.
    world: Order,
    split: Split,
}

/// Which node reads each file in one epoch, and where in that node's stream, as seen from
/// one node.
pub struct Readers {
    pub epoch: u64,
    /// The announcement of the epoch whole they come from (0: computed from an order).
    pub version: u64,
    /// The node these readers are seen from.
    node: usize,
    node_of: Vec<u16>,
    offset: Vec<u32>,
}

impl Readers {
    /// The node that reads `file` in this epoch (the last one, for a file two ranks read).
    pub fn node_of(&self, file: FileId) -> Option<usize> {
        match self.node_of.get(file as usize) {
            Some(&n) if n != NOBODY => Some(n as usize),
            _ => None,
        }
    }

    /// Where `file` is in its reader's node stream.
    pub fn offset_of(&self, file: FileId) -> Option<u64> {
        self.node_of(file)?;
        Some(u64::from(self.offset[file as usize]))
    }

    /// The files this node reads in this epoch that another node reads in `next` (the epoch
    /// after), with where in that node's stream: what its peers will fetch from it.
    pub fn needs(&self, next: &Readers) -> Vec<(FileId, u64)> {
        (0..self.node_of.len() as FileId)
            .filter(|&f| self.node_of(f) == Some(self.node))
            .filter_map(|f| match next.node_of(f) {
                Some(n) if n != self.node => Some((f, next.offset_of(f)?)),
                _ => None,
            })
            .collect()
    }

    /// The node that read `file` in this epoch, if another than this one.
    pub fn holder(&self, file: FileId) -> Option<usize> {
        self.node_of(file).filter(|&n| n != self.node)
    }
}

impl Split {
    /// Node `node` of `nodes`, serving `ranks` of a world of `world_size`: refused unless the
    /// world splits evenly over the nodes and `ranks` are within this node's block (a rank
    /// of the block that does not run here is taken for this node's all the same: what the
    /// others ask of it then falls back to SOURCE).
    pub fn new(
        world_size: u32,
        ranks: &[u32],
        nodes: usize,
        node: usize,
    ) -> Result<Split, PlacementError> {
        if nodes == 0
            || nodes > NOBODY as usize
            || (world_size as usize) < nodes
            || !(world_size as usize).is_multiple_of(nodes)
        {
            return Err(PlacementError::World {
                world: world_size,
                nodes,
            });
        }
        let ranks_per_node = world_size / nodes as u32;
        let first = node as u32 * ranks_per_node;
        let last = first + ranks_per_node - 1;
        if ranks.is_empty() || !ranks.iter().all(|r| (first..=last).contains(r)) {
            return Err(PlacementError::Ranks {
                node,
                nodes,
                first,
                last,
                ranks: ranks.to_vec(),
            });
        }
        Ok(Split {
            node,
            world_size,
            ranks_per_node,
        })
    }

    /// Who reads each file of `epoch`, whose whole order is `world` (rank `p % W` reads
    /// position `p`; `version` says which announcement of it), over file ids below
    /// `id_space`.
    pub fn readers(
        &self,
        (epoch, version): (u64, u64),
        world: &[MaybeFile],
        id_space: usize,
    ) -> Readers {
        let world_size = self.world_size as usize;
        let per_node = self.ranks_per_node as usize;
        let mut node_of = vec![NOBODY; id_space];
        let mut offset = vec![0u32; id_space];
        for (p, file) in world.iter().enumerate() {
            let Some(file) = file.get() else { continue };
            let Some(slot) = node_of.get_mut(file as usize) else {
                continue;
            };
            let rank = p % world_size;
            *slot = (rank / per_node) as u16;
            offset[file as usize] = ((p / world_size) * per_node + rank % per_node) as u32;
        }
        Readers {
            epoch,
            version,
            node: self.node,
            node_of,
            offset,
        }
    }
}

impl Placement {
    /// The placement of `order` (this node's) over `nodes` nodes, this one `node`: refused
    /// unless it is a DistributedSampler whose world splits evenly over the nodes and this
    /// node has its block of ranks.
    pub fn new(order: &Order, nodes: usize, node: usize) -> Result<Placement, PlacementError> {
        let sampler = &order.sampler;
        if sampler.kind != SamplerKind::TorchDistributed {
            return Err(PlacementError::NotDistributed);
        }
        let split = Split::new(sampler.world_size, &order.ranks, nodes, node)?;
        Ok(Placement {
            world: Order {
                sampler: sampler.clone(),
                ranks: (0..sampler.world_size).collect(),
                layout: Arc::clone(&order.layout),
            },
            split,
        })
    }

    /// Who reads each file in `epoch`, over file ids below `id_space`.
    pub fn readers(&self, epoch: u64, id_space: usize) -> Readers {
        (self.split).readers((epoch, 0), &self.world.stream(epoch), id_space)
    }
}
