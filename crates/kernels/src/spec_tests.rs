//! `moefuse-spec` against the C side this crate carries: the generated `spec.h`, the
//! limits abi.h and moe_abi.h state, the moe kernels' tables and the ffi mirror.

use crate::ffi;
use moefuse_spec::tile_order::{self, Raster, TileOrder};
use moefuse_spec::{c_header, GroupedKind, MAX_EXPERTS, MAX_TOP_K};
use std::mem::size_of_val;

fn cuda_file(rel: &str) -> String {
    let path = format!("{}/cuda/{rel}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn spec_h_is_generated_from_moefuse_spec() {
    assert!(
        cuda_file("include/moefuse/spec.h") == c_header(),
        "cuda/include/moefuse/spec.h differs from crates/spec: run `cargo xtask gen-spec`"
    );
}

#[test]
fn abi_headers_state_the_spec_limits() {
    let router = format!("1 <= experts <= {MAX_EXPERTS}, 1 <= top_k <= min({MAX_TOP_K}, experts)");
    assert!(
        cuda_file("include/moefuse/abi.h").contains(&router),
        "abi.h's router comment should say `{router}`"
    );
    let permute = format!("1 <= experts <= {MAX_EXPERTS}, 1 <= top_k <= {MAX_TOP_K};");
    assert!(
        cuda_file("include/moefuse/moe_abi.h").contains(&permute),
        "moe_abi.h's permutation comment should say `{permute}`"
    );
}

#[test]
fn moe_kernels_size_their_tables_from_spec_h() {
    for unit in ["moe/router.cu", "moe/permute.cu"] {
        let text = cuda_file(unit);
        assert!(text.contains("#include \"moefuse/spec.h\""), "{unit}");
        assert!(
            text.contains("kMaxExperts = MOEFUSE_SPEC_MAX_EXPERTS")
                && text.contains("kMaxTopK = MOEFUSE_SPEC_MAX_TOP_K"),
            "{unit} should take its limits from spec.h, not literals"
        );
    }
}

#[test]
fn ffi_mirror_carries_every_tile_order_and_grouped_kind() {
    let args = ffi::MoefuseGroupedGemmArgs {
        num_groups: 0,
        total_rows: 0,
        n: 0,
        k: 0,
        b_layout: ffi::MOEFUSE_B_LAYOUT_NK,
        tile_order: 0,
        offsets: std::ptr::null(),
        a: std::ptr::null(),
        b: std::ptr::null(),
        d: std::ptr::null_mut(),
        alpha: 1.0,
        beta: 0.0,
        b_rows: std::ptr::null(),
        b_rows_div: 1,
        b_source_rows: 0,
        a_rows: std::ptr::null(),
        a_rows_div: 1,
        a_source_rows: 0,
    };
    // Every field sits below the sign bit of the ABI's int32 word.
    let last = tile_order::INTERLEAVE;
    assert!(((last.shift + last.bits) as usize) < 8 * size_of_val(&args.tile_order));
    let widest = TileOrder {
        raster: Raster::AlongN,
        swizzle: 128,
        prefetch: 255,
        interleave: true,
    };
    let word = widest.encode();
    assert!(word > 0);
    assert_eq!(word & !tile_order::CONTIGUOUS_MASK, 0);
    assert_eq!(TileOrder::decode(word, true), Ok(widest));
    // The variants' ops name each grouped kind; the generated instances spell the C++ one.
    for kind in GroupedKind::ALL {
        let v = crate::VARIANTS
            .iter()
            .find(|v| {
                v.op.grouped_kind() == Some(kind) && v.schedule != crate::Schedule::Contiguous
            })
            .unwrap_or_else(|| panic!("no ptr-array variant of kind {kind}"));
        assert!(v.instance_source().contains(kind.cpp()), "{}", v.name());
    }
}

/// The value of `#define NAME value` in a header (integers only).
fn header_define(header: &str, name: &str) -> i64 {
    let text = cuda_file(header);
    let line = text
        .lines()
        .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
        .unwrap_or_else(|| panic!("{header} defines no {name}"));
    let value = line.split_whitespace().nth(2).unwrap_or_default();
    value
        .parse()
        .unwrap_or_else(|e| panic!("{header}: {name} = {value:?}: {e}"))
}

#[test]
fn ffi_mirror_carries_the_decode_constants() {
    let h = "include/moefuse/moe_abi.h";
    let pairs: [(&str, i64); 2] = [
        (
            "MOEFUSE_DECODE_MAX_TOKENS",
            ffi::MOEFUSE_DECODE_MAX_TOKENS as i64,
        ),
        (
            "MOEFUSE_DECODE_MAX_SLOTS",
            ffi::MOEFUSE_DECODE_MAX_SLOTS as i64,
        ),
    ];
    for (name, mirrored) in pairs {
        assert_eq!(
            header_define(h, name),
            mirrored,
            "{name}: moe_abi.h against ffi.rs"
        );
    }
}
