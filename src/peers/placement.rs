//! Who reads what, on every node, computed: the job's whole order (every rank's share of each
//! epoch) from the same sampler, seed and world size each node predicts its own stream with.
//! Node `i` of `N` serves ranks `i*W/N .. (i+1)*W/N` (how launchers number ranks: a node's
//! local ranks are consecutive), so the node that read file f in epoch e, and still holds it,
//! is known to every node without a message.

use std::sync::Arc;

use crate::catalog::FileId;
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
        "node {node} of {nodes} must serve ranks {first}..={last} (consecutive ranks per node), not {ranks:?}"
    )]
    Ranks {
        node: usize,
        nodes: usize,
        first: u32,
        last: u32,
        ranks: Vec<u32>,
    },
}

/// The job's nodes and how its ranks are spread over them.
pub struct Placement {
    /// The job's order with every rank: its stream is the whole world's, rank `p % W` at `p`.
    world: Order,
    nodes: usize,
    node: usize,
    ranks_per_node: u32,
}

/// Which node reads each file in one epoch, and where in that node's stream.
pub struct Readers {
    pub epoch: u64,
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
        let world = sampler.world_size;
        if nodes == 0 || !(world as usize).is_multiple_of(nodes) {
            return Err(PlacementError::World { world, nodes });
        }
        let ranks_per_node = world / nodes as u32;
        let first = node as u32 * ranks_per_node;
        let last = first + ranks_per_node - 1;
        let mut ranks = order.ranks.clone();
        ranks.sort_unstable();
        if !ranks.iter().copied().eq(first..=last) {
            return Err(PlacementError::Ranks {
                node,
                nodes,
                first,
                last,
                ranks: order.ranks.clone(),
            });
        }
        Ok(Placement {
            world: Order {
                sampler: sampler.clone(),
                ranks: (0..world).collect(),
                layout: Arc::clone(&order.layout),
            },
            nodes,
            node,
            ranks_per_node,
        })
    }

    pub fn node(&self) -> usize {
        self.node
    }

    /// Who reads each file in `epoch`, over file ids below `id_space`.
    pub fn readers(&self, epoch: u64, id_space: usize) -> Readers {
        let world = self.world.sampler.world_size as usize;
        let per_node = self.ranks_per_node as usize;
        let mut node_of = vec![NOBODY; id_space];
        let mut offset = vec![0u32; id_space];
        for (p, file) in self.world.stream(epoch).into_iter().enumerate() {
            let Some(file) = file.get() else { continue };
            let Some(slot) = node_of.get_mut(file as usize) else {
                continue;
            };
            let rank = p % world;
            *slot = (rank / per_node) as u16;
            offset[file as usize] = ((p / world) * per_node + rank % per_node) as u32;
        }
        debug_assert!(self.nodes <= NOBODY as usize);
        Readers {
            epoch,
            node_of,
            offset,
        }
    }

    /// The files this node reads in `held`'s epoch that another node reads in `next` (the
    /// epoch after), with where in that node's stream: what its peers will fetch from it.
    pub fn needs(&self, held: &Readers, next: &Readers) -> Vec<(FileId, u64)> {
        (0..held.node_of.len() as FileId)
            .filter(|&f| held.node_of(f) == Some(self.node))
            .filter_map(|f| match next.node_of(f) {
                Some(n) if n != self.node => Some((f, next.offset_of(f)?)),
                _ => None,
            })
            .collect()
    }

    /// The node that read `file` in `held`'s epoch, if another than this one.
    pub fn holder(&self, held: &Readers, file: FileId) -> Option<usize> {
        held.node_of(file).filter(|&n| n != self.node)
    }
}
