//! What keeps one rank's mistake from hanging or corrupting the others: the configuration
//! handshake of `ExpertParallel::new`, the fault words the kernels write when a wait on a
//! peer gives up, and the checks on caller operands. Host-only logic, unit-tested here.

use super::params::{
    ABORTED, FAULT_WORDS, HELLO_MAGIC, HELLO_WORDS, LOCAL_ABORT, OP_BACKWARD, OP_COMBINE,
    OP_EXPAND, OP_NOTIFY, TIMEOUT,
};
use super::EpConfig;
use crate::CommError;
use std::time::Duration;

/// Bumped whenever the kernels' protocol changes, so that two builds never agree by accident.
const PROTOCOL: u64 = 2;

/// The configuration hash every rank sends at construction: FNV-1a over the protocol
/// version and the sizes every buffer derives from. The deadline is not part of it (ranks
/// may wait for different times without corrupting each other).
pub(crate) fn config_hash(cfg: &EpConfig) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in [
        PROTOCOL,
        cfg.experts as u64,
        cfg.top_k as u64,
        cfg.hidden as u64,
        cfg.max_tokens as u64,
        cfg.pull_rows as u64,
    ] {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Reads the handshake table (row r = rank r's record, as its kernel put it here): every
/// rank must have sent one, with this rank's hash. Returns the epoch base every rank
/// agrees on: the largest any rank proposed, so that no signal of an earlier instance (on
/// any rank) can satisfy a wait of this one.
pub(crate) fn agree(table: &[u64], rank: usize, ours: u64) -> Result<u64, CommError> {
    let mut base = 0;
    for (peer, row) in table.chunks_exact(HELLO_WORDS).enumerate() {
        if row[0] != HELLO_MAGIC || row[3] != peer as u64 {
            return Err(CommError::HandshakeMissing { rank, peer });
        }
        if row[1] != ours {
            return Err(CommError::ConfigMismatch {
                rank,
                peer,
                ours,
                theirs: row[1],
            });
        }
        base = base.max(row[2]);
    }
    Ok(base)
}

fn op_name(op: u64) -> &'static str {
    match op {
        OP_NOTIFY => "dispatch (count exchange)",
        OP_EXPAND => "dispatch (receiving tokens)",
        OP_COMBINE => "combine (receiving partial sums)",
        OP_BACKWARD => "pulled backward (receiving dy or dx rows)",
        _ => "expert-parallel exchange",
    }
}

/// The error the fault words `[kind | op << 8, peer, waited ns, epoch]` describe (`None`
/// when no fault was recorded).
pub(crate) fn decode_fault(words: [u64; FAULT_WORDS]) -> Option<CommError> {
    let (kind, op) = (words[0] & 0xff, (words[0] >> 8) & 0xff);
    let peer = words[1] as usize;
    match kind {
        0 => None,
        TIMEOUT => Some(CommError::PeerTimeout {
            op: op_name(op),
            peer,
            waited: Duration::from_nanos(words[2]),
        }),
        ABORTED => Some(CommError::PeerAborted {
            op: op_name(op),
            peer,
        }),
        LOCAL_ABORT => Some(CommError::Poisoned {
            cause: format!("this rank abandoned {} after a local error", op_name(op)),
        }),
        _ => Some(CommError::Poisoned {
            cause: format!("unknown fault word {:#x}", words[0]),
        }),
    }
}

/// A caller operand: at least `align`-byte aligned (the kernels move rows in 16-byte
/// vectors) and on the runtime's device (`device`: where the driver says the memory lives,
/// `None` when it is not device memory at all).
pub(crate) fn check_operand(
    what: &'static str,
    addr: u64,
    align: usize,
    device: Option<usize>,
    expected: usize,
) -> Result<(), CommError> {
    if addr % align as u64 != 0 {
        return Err(CommError::Misaligned { what, addr, align });
    }
    match device {
        None => Err(CommError::NotDeviceMemory { what, addr }),
        Some(found) if found != expected => Err(CommError::WrongDevice {
            what,
            expected,
            found,
        }),
        Some(_) => Ok(()),
    }
}

/// How long the host waits for an exchange's stream work before it gives up: every device
/// wait ends at its deadline, and a call holds at most three in a row.
pub(crate) fn host_deadline(timeout: Duration) -> Duration {
    timeout * 4 + Duration::from_secs(10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EpConfig {
        EpConfig::new(128, 8, 2048, 4096)
    }

    #[test]
    fn the_hash_sees_every_size_and_the_row_mode_but_not_the_deadline() {
        let base = config_hash(&cfg());
        for other in [
            EpConfig {
                experts: 64,
                ..cfg()
            },
            EpConfig { top_k: 4, ..cfg() },
            EpConfig {
                hidden: 4096,
                ..cfg()
            },
            EpConfig {
                max_tokens: 4097,
                ..cfg()
            },
            cfg().pulled(),
        ] {
            assert_ne!(config_hash(&other), base, "{other:?}");
        }
        let slower = EpConfig {
            timeout: Duration::from_secs(99),
            ..cfg()
        };
        assert_eq!(config_hash(&slower), base);
    }

    /// A rank's handshake record as `moefuse_ep_hello` writes it.
    fn hello_record(hash: u64, epoch_base: u64, rank: usize) -> [u64; HELLO_WORDS] {
        [HELLO_MAGIC, hash, epoch_base, rank as u64]
    }

    fn table(records: &[[u64; HELLO_WORDS]]) -> Vec<u64> {
        records.iter().flatten().copied().collect()
    }

    #[test]
    fn a_peer_with_other_sizes_is_named_on_every_rank() {
        let (ours, theirs) = (
            config_hash(&cfg()),
            config_hash(&EpConfig {
                max_tokens: 8192,
                ..cfg()
            }),
        );
        let t = table(&[hello_record(ours, 0, 0), hello_record(theirs, 0, 1)]);
        assert_eq!(
            agree(&t, 0, ours),
            Err(CommError::ConfigMismatch {
                rank: 0,
                peer: 1,
                ours,
                theirs
            })
        );
        // Rank 1 sees the same table and fails on rank 0's record.
        assert!(matches!(
            agree(&t, 1, theirs),
            Err(CommError::ConfigMismatch { peer: 0, .. })
        ));
    }

    #[test]
    fn a_missing_record_is_an_error_not_a_hang() {
        let h = config_hash(&cfg());
        let mut t = table(&[
            hello_record(h, 0, 0),
            hello_record(h, 0, 1),
            hello_record(h, 0, 2),
        ]);
        t[HELLO_WORDS * 2] = 0; // rank 2's never arrived (zeroed table)
        assert_eq!(
            agree(&t, 0, h),
            Err(CommError::HandshakeMissing { rank: 0, peer: 2 })
        );
        let mut t = table(&[hello_record(h, 0, 0), hello_record(h, 0, 0)]);
        assert!(agree(&t, 0, h).is_err(), "a record in the wrong row");
        t[HELLO_WORDS + 3] = 1;
        assert_eq!(agree(&t, 0, h), Ok(0));
    }

    #[test]
    fn the_epoch_base_is_the_largest_any_rank_used() {
        // Rank 1's earlier instance ran 7 calls, rank 0's 5 (it timed out early): a new
        // instance starts above both, so rank 1's late signals (epoch <= 7) satisfy nothing.
        let h = config_hash(&cfg());
        let t = table(&[
            hello_record(h, 5, 0),
            hello_record(h, 7, 1),
            hello_record(h, 0, 2),
        ]);
        for rank in 0..3 {
            assert_eq!(agree(&t, rank, h), Ok(7));
        }
    }

    #[test]
    fn fault_words_decode_to_typed_errors() {
        assert_eq!(decode_fault([0; 4]), None);
        assert_eq!(
            decode_fault([TIMEOUT | OP_NOTIFY << 8, 1, 2_500_000_000, 9]),
            Some(CommError::PeerTimeout {
                op: "dispatch (count exchange)",
                peer: 1,
                waited: Duration::from_millis(2500)
            })
        );
        assert_eq!(
            decode_fault([ABORTED | OP_COMBINE << 8, 3, 10, 9]),
            Some(CommError::PeerAborted {
                op: "combine (receiving partial sums)",
                peer: 3
            })
        );
        assert!(matches!(
            decode_fault([LOCAL_ABORT | OP_EXPAND << 8, 0, 0, 1]),
            Some(CommError::Poisoned { .. })
        ));
        assert!(matches!(
            decode_fault([0x77, 0, 0, 0]),
            Some(CommError::Poisoned { .. })
        ));
    }

    #[test]
    fn operands_must_be_aligned_device_memory_on_our_device() {
        assert_eq!(check_operand("x", 0x1000, 16, Some(0), 0), Ok(()));
        assert_eq!(
            check_operand("x", 0x1002, 16, Some(0), 0),
            Err(CommError::Misaligned {
                what: "x",
                addr: 0x1002,
                align: 16
            })
        );
        assert_eq!(
            check_operand("out", 0x1008, 16, Some(0), 0),
            Err(CommError::Misaligned {
                what: "out",
                addr: 0x1008,
                align: 16
            })
        );
        assert_eq!(check_operand("topk_ids", 0x1004, 4, Some(0), 0), Ok(()));
        assert_eq!(
            check_operand("y", 0x2000, 16, Some(1), 0),
            Err(CommError::WrongDevice {
                what: "y",
                expected: 0,
                found: 1
            })
        );
        assert_eq!(
            check_operand("y", 0x2000, 16, None, 0),
            Err(CommError::NotDeviceMemory {
                what: "y",
                addr: 0x2000
            })
        );
    }

    #[test]
    fn the_host_waits_longer_than_the_device() {
        let t = Duration::from_secs(10);
        assert!(host_deadline(t) > 3 * t);
    }
}
