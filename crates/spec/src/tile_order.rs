//! The tile-order word of `moefuse_grouped_gemm_args::tile_order`: which output tiles of a
//! grouped GEMM run together, packed into one `int32`.
//!
//! | bits | field | ptr-array variants (CUTLASS's scheduler) | contiguous variants (`_contig`) |
//! |---|---|---|---|
//! | 0–1 | [`RASTER`] | 0 default, 1 along M, 2 along N | 0/2 a band's n-blocks first, 1 its m-blocks first |
//! | 8–15 | [`WIDTH`] | max swizzle: 0 or 1 none, 2, 4, 8 | band height in m-blocks: 0 default, else a power of two |
//! | 16–23 | [`PREFETCH`] | must be 0 | k-blocks of the next tile prefetched into L2 |
//! | 24 | [`INTERLEAVE`] | must be 0 | the tile list's front and back alternate |
//!
//! [`TileOrder`] is the unpacked form; `moefuse-grouped-gemm` exposes it, and
//! `moefuse-kernels` checks every word with [`TileOrder::decode`] before a launch.
//! `spec.h` carries the shifts and masks for the C side.
//!
//! ```
//! use moefuse_spec::tile_order::{Raster, TileOrder};
//! let order = TileOrder { raster: Raster::AlongN, swizzle: 4, ..TileOrder::default() };
//! let word = order.encode();
//! assert_eq!(word, 2 | (4 << 8));
//! assert_eq!(TileOrder::decode(word, false), Ok(order));
//! ```

use std::fmt;

/// One field of the word: `bits` bits from bit `shift`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Name, as `spec.h`'s `MOEFUSE_SPEC_TILE_ORDER_<NAME>_*` spells it (lower case here).
    pub name: &'static str,
    /// Position of the lowest bit.
    pub shift: u32,
    /// Width in bits.
    pub bits: u32,
}

impl Field {
    /// The largest value the field holds.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::tile_order::WIDTH.max(), 255);
    /// ```
    pub const fn max(self) -> i32 {
        (1 << self.bits) - 1
    }

    /// The field's bits in place in the word.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::tile_order::WIDTH.mask(), 0xff00);
    /// ```
    pub const fn mask(self) -> i32 {
        self.max() << self.shift
    }

    /// The field's value in `word`.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::tile_order::PREFETCH.get(3 << 16 | 2), 3);
    /// ```
    pub const fn get(self, word: i32) -> i32 {
        (word >> self.shift) & self.max()
    }

    /// `value` in place, cut to the field's width.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::tile_order::INTERLEAVE.put(1), 1 << 24);
    /// ```
    pub const fn put(self, value: i32) -> i32 {
        (value & self.max()) << self.shift
    }
}

/// Bits 0–1: the walk direction ([`Raster`]).
pub const RASTER: Field = Field {
    name: "raster",
    shift: 0,
    bits: 2,
};
/// Bits 8–15: the max swizzle width (ptr-array variants) or the band height in m-blocks
/// (contiguous variants).
pub const WIDTH: Field = Field {
    name: "width",
    shift: 8,
    bits: 8,
};
/// Bits 16–23: k-blocks of each CTA's next tile prefetched into L2 (contiguous only).
pub const PREFETCH: Field = Field {
    name: "prefetch",
    shift: 16,
    bits: 8,
};
/// Bit 24: alternate the front and the back of the tile list (contiguous only).
pub const INTERLEAVE: Field = Field {
    name: "interleave",
    shift: 24,
    bits: 1,
};
/// Every field, low bits first.
pub const FIELDS: [Field; 4] = [RASTER, WIDTH, PREFETCH, INTERLEAVE];

/// The bits a ptr-array (CUTLASS-scheduled) variant reads: raster and swizzle.
///
/// ```
/// assert_eq!(moefuse_spec::tile_order::PTR_ARRAY_MASK, 0xff03);
/// ```
pub const PTR_ARRAY_MASK: i32 = RASTER.mask() | WIDTH.mask();
/// The bits a contiguous variant reads: every field.
///
/// ```
/// assert_eq!(moefuse_spec::tile_order::CONTIGUOUS_MASK, 0x1ff_ff03);
/// ```
pub const CONTIGUOUS_MASK: i32 = PTR_ARRAY_MASK | PREFETCH.mask() | INTERLEAVE.mask();
/// Largest swizzle CUTLASS's grouped scheduler takes.
pub const MAX_SWIZZLE: i32 = 8;
/// Largest band height of the contiguous kernel (the largest power of two in [`WIDTH`]).
pub const MAX_BAND: i32 = 128;

/// Walk direction of the tile scheduler ([`RASTER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(i32)]
pub enum Raster {
    /// The kernel's default (CUTLASS's grouped scheduler: along M).
    #[default]
    Default = 0,
    /// Consecutive tiles step along M (one column block of B stays hot).
    AlongM = 1,
    /// Consecutive tiles step along N (one row block of A stays hot).
    AlongN = 2,
}

impl Raster {
    /// Every direction, in code order.
    pub const ALL: [Raster; 3] = [Raster::Default, Raster::AlongM, Raster::AlongN];

    /// The field value.
    ///
    /// ```
    /// assert_eq!(moefuse_spec::tile_order::Raster::AlongN.code(), 2);
    /// ```
    pub const fn code(self) -> i32 {
        self as i32
    }

    /// The direction of field value `code`, if any (3 is none).
    ///
    /// ```
    /// use moefuse_spec::tile_order::Raster;
    /// assert_eq!(Raster::from_code(1), Some(Raster::AlongM));
    /// assert_eq!(Raster::from_code(3), None);
    /// ```
    pub const fn from_code(code: i32) -> Option<Raster> {
        match code {
            0 => Some(Raster::Default),
            1 => Some(Raster::AlongM),
            2 => Some(Raster::AlongN),
            _ => None,
        }
    }
}

/// The tile order, unpacked: rasterisation of the output tiles inside a group and the
/// swizzle or band width, which decide which operand tiles stay in L2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TileOrder {
    /// Walk direction.
    pub raster: Raster,
    /// CUTLASS's schedulers: max swizzle width 0 or 1 (none), 2, 4 or 8. The contiguous
    /// kernel (`..._contig` variants): band height in m-blocks, 0 (its default, 16) or a
    /// power of two up to 128; `AlongM` walks a band's m-blocks first, else its n-blocks.
    pub swizzle: u8,
    /// The contiguous kernel only: k-blocks of each CTA's next tile prefetched into L2 while
    /// it works on the current one (0, the default: none; a tuning knob that measured no
    /// gain on the H200, docs/perf-notes.md).
    pub prefetch: u8,
    /// The contiguous kernel only: alternate the front and the back of the tile list, so
    /// the tiles running at once mix early and late groups (false, the default: measured in
    /// docs/perf-notes.md; it spreads the weight reads of routing that puts large groups
    /// first and many small ones last).
    pub interleave: bool,
}

impl TileOrder {
    /// The word `moefuse_grouped_gemm_args::tile_order` carries (every field fits; whether a
    /// variant takes it is [`TileOrder::check`]'s question).
    ///
    /// ```
    /// use moefuse_spec::tile_order::TileOrder;
    /// let o = TileOrder { prefetch: 2, interleave: true, ..TileOrder::default() };
    /// assert_eq!(o.encode(), (2 << 16) | (1 << 24));
    /// ```
    pub const fn encode(self) -> i32 {
        RASTER.put(self.raster.code())
            | WIDTH.put(self.swizzle as i32)
            | PREFETCH.put(self.prefetch as i32)
            | INTERLEAVE.put(self.interleave as i32)
    }

    /// Whether a variant takes this order: `contiguous` for the `_contig` variants, which
    /// read every field; the ptr-array ones read raster and a swizzle up to
    /// [`MAX_SWIZZLE`]. The width is 0 or a power of two either way.
    ///
    /// ```
    /// use moefuse_spec::tile_order::{TileOrder, TileOrderError};
    /// let band = TileOrder { swizzle: 32, ..TileOrder::default() };
    /// assert!(band.check(true).is_ok());
    /// assert_eq!(band.check(false), Err(TileOrderError::Width { width: 32, max: 8 }));
    /// ```
    pub const fn check(self, contiguous: bool) -> Result<(), TileOrderError> {
        let width = self.swizzle as i32;
        let max = if contiguous { MAX_BAND } else { MAX_SWIZZLE };
        if width > max || (width != 0 && !self.swizzle.is_power_of_two()) {
            return Err(TileOrderError::Width { width, max });
        }
        if !contiguous && self.prefetch != 0 {
            return Err(TileOrderError::ContiguousOnly {
                field: PREFETCH.name,
            });
        }
        if !contiguous && self.interleave {
            return Err(TileOrderError::ContiguousOnly {
                field: INTERLEAVE.name,
            });
        }
        Ok(())
    }

    /// Unpacks and checks a word as the kernels read it (see [`TileOrder::check`]).
    ///
    /// ```
    /// use moefuse_spec::tile_order::{TileOrder, TileOrderError};
    /// assert_eq!(TileOrder::decode(3, false), Err(TileOrderError::Raster { code: 3 }));
    /// assert!(TileOrder::decode(1 << 24, true).unwrap().interleave);
    /// ```
    pub const fn decode(word: i32, contiguous: bool) -> Result<TileOrder, TileOrderError> {
        let allowed = if contiguous {
            CONTIGUOUS_MASK
        } else {
            PTR_ARRAY_MASK
        };
        let stray = word & !allowed;
        if stray != 0 {
            // Bits that are fields of the other kind name the field, others the bits.
            if !contiguous && stray & !CONTIGUOUS_MASK == 0 {
                let field = if stray & PREFETCH.mask() != 0 {
                    PREFETCH
                } else {
                    INTERLEAVE
                };
                return Err(TileOrderError::ContiguousOnly { field: field.name });
            }
            return Err(TileOrderError::StrayBits {
                bits: stray,
                allowed,
            });
        }
        let raster = match Raster::from_code(RASTER.get(word)) {
            Some(r) => r,
            None => {
                return Err(TileOrderError::Raster {
                    code: RASTER.get(word),
                })
            }
        };
        let order = TileOrder {
            raster,
            swizzle: WIDTH.get(word) as u8,
            prefetch: PREFETCH.get(word) as u8,
            interleave: INTERLEAVE.get(word) != 0,
        };
        match order.check(contiguous) {
            Ok(()) => Ok(order),
            Err(e) => Err(e),
        }
    }
}

/// Why a tile order is refused. Plain `std` (this crate has no dependencies); the crates
/// above wrap it with `#[source]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileOrderError {
    /// Raster code 3 names no direction.
    Raster {
        /// The field's value.
        code: i32,
    },
    /// The swizzle or band width is not 0 or a power of two up to `max`.
    Width {
        /// The field's value.
        width: i32,
        /// The largest the variant takes ([`MAX_SWIZZLE`] or [`MAX_BAND`]).
        max: i32,
    },
    /// A contiguous-only field (`prefetch`, `interleave`) set for a ptr-array variant.
    ContiguousOnly {
        /// The field.
        field: &'static str,
    },
    /// Bits that belong to no field.
    StrayBits {
        /// The offending bits.
        bits: i32,
        /// The bits the variant reads.
        allowed: i32,
    },
}

impl fmt::Display for TileOrderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TileOrderError::Raster { code } => {
                write!(f, "tile order raster {code}: must be 0 (default), 1 (along M) or 2 (along N)")
            }
            TileOrderError::Width { width, max } => write!(
                f,
                "tile order swizzle/band {width}: must be 0 or a power of two up to {max} for this variant"
            ),
            TileOrderError::ContiguousOnly { field } => write!(
                f,
                "tile order {field} is for the contiguous (`_contig`) variants only"
            ),
            TileOrderError::StrayBits { bits, allowed } => write!(
                f,
                "tile order bits {bits:#x} belong to no field (this variant reads {allowed:#x})"
            ),
        }
    }
}

impl std::error::Error for TileOrderError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_disjoint_and_fit_int32() {
        let mut seen = 0i32;
        for f in FIELDS {
            assert_eq!(seen & f.mask(), 0, "{} overlaps an earlier field", f.name);
            assert!(
                f.shift + f.bits < 32,
                "{} must stay clear of the sign bit",
                f.name
            );
            seen |= f.mask();
        }
        assert_eq!(seen, CONTIGUOUS_MASK);
        assert!(MAX_SWIZZLE <= WIDTH.max() && MAX_BAND <= WIDTH.max());
        assert!(Raster::ALL.iter().all(|r| r.code() <= RASTER.max()));
    }

    #[test]
    fn every_accepted_order_round_trips() {
        for contiguous in [false, true] {
            for raster in Raster::ALL {
                for swizzle in 0..=255u8 {
                    for (prefetch, interleave) in [(0, false), (4, false), (0, true), (255, true)] {
                        let o = TileOrder {
                            raster,
                            swizzle,
                            prefetch,
                            interleave,
                        };
                        let decoded = TileOrder::decode(o.encode(), contiguous);
                        assert_eq!(decoded.is_ok(), o.check(contiguous).is_ok(), "{o:?}");
                        if let Ok(d) = decoded {
                            assert_eq!(d, o, "contiguous {contiguous}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn decode_names_the_rule() {
        use TileOrderError::*;
        assert_eq!(
            TileOrder::decode(3 << 8, false),
            Err(Width { width: 3, max: 8 })
        );
        assert_eq!(
            TileOrder::decode(16 << 8, false),
            Err(Width { width: 16, max: 8 })
        );
        assert!(TileOrder::decode(128 << 8, true).is_ok());
        assert_eq!(
            TileOrder::decode(1 << 24, false),
            Err(ContiguousOnly {
                field: "interleave"
            })
        );
        assert_eq!(
            TileOrder::decode(4 << 16, false),
            Err(ContiguousOnly { field: "prefetch" })
        );
        assert_eq!(
            TileOrder::decode(1 << 25, true),
            Err(StrayBits {
                bits: 1 << 25,
                allowed: 0x1ff_ff03
            })
        );
        assert_eq!(
            TileOrder::decode(-1, true).map_err(|e| matches!(e, StrayBits { .. })),
            Err(true)
        );
        assert_eq!(
            TileOrder::decode(1 << 2, false),
            Err(StrayBits {
                bits: 4,
                allowed: 0xff03
            })
        );
    }
}
