"""What may reach the shadow catalog: an allow-list of functions, a deny-list of activity views.

Everything routed to the shadow (a statement naming only catalog relations, or none at all) is
free and runs on a server that every analyst shares, so it must not be able to *do* anything:
sleep for long, write large objects, take advisory locks, read files, see other analysts'
sessions. The statement itself is already a read-only head (``SELECT``/``WITH``/``VALUES``/
``TABLE``, see :func:`dpsql.server.catalog.route_of`); here every *function call* in it must be
on :data:`ALLOWED_FUNCTIONS` (catalog introspection, formatting, string/array/JSON helpers,
aggregates: what psql, pgcli, JDBC, SQLAlchemy, asyncpg and pg8000 send) and no relation may be
one of the views that show other sessions (:func:`denied_relation`). The check is lexical
(psql's ``OPERATOR(pg_catalog.~)`` defeats SQL parsers) and errs on the side of refusing: an
unknown name followed by ``(`` is refused even where it would have been a column alias.

The shadow enforces the same from its side (non-superuser role, revoked functions and views,
read-only transactions, a statement timeout): this check gives the analyst a clear error with
a hint, the shadow's own permissions are the backstop.
"""

from __future__ import annotations

from dpsql import errors
from dpsql.errors import Error, InsufficientPrivilege
from dpsql.sqltext import Lexeme, Token, catalog_tokens


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Words that may stand before "(" without being a function call.
_SYNTAX = _words(
    """
    select from where and or not in exists any all some array row values cast operator as on join
    using lateral over filter within group by partition order having when then else case is like
    ilike similar to between union intersect except distinct limit offset fetch with recursive
    materialized return returning escape collate ordinality only rows range groups preceding
    following unbounded current tablesample
    """
)

_TYPES = """
    varchar char character varying numeric decimal bit varbit timestamp timestamptz time timetz
    interval float float4 float8 bpchar int int2 int4 int8 integer smallint bigint real text bool
    boolean name oid regclass regtype regproc regprocedure regnamespace regrole regoper
    regoperator regconfig regcollation date bytea json jsonb uuid inet cidr double precision
"""

_CATALOG_FUNCTIONS = """
    format_type pg_get_expr pg_get_indexdef pg_get_constraintdef pg_get_viewdef pg_get_triggerdef
    pg_get_ruledef pg_get_userbyid pg_get_function_arguments pg_get_function_identity_arguments
    pg_get_function_result pg_get_function_arg_default pg_get_functiondef pg_get_serial_sequence
    pg_get_keywords pg_relation_is_publishable pg_get_publication_tables
    pg_get_partkeydef pg_get_partition_constraintdef pg_get_statisticsobjdef
    pg_get_statisticsobjdef_columns pg_get_statisticsobjdef_expressions pg_get_catalog_foreign_keys
    pg_get_object_address pg_identify_object pg_identify_object_as_address pg_describe_object
    pg_table_is_visible pg_type_is_visible pg_function_is_visible pg_operator_is_visible
    pg_opclass_is_visible pg_opfamily_is_visible pg_collation_is_visible pg_conversion_is_visible
    pg_statistics_obj_is_visible pg_ts_config_is_visible pg_ts_dict_is_visible
    pg_ts_parser_is_visible pg_ts_template_is_visible obj_description col_description
    shobj_description has_table_privilege has_column_privilege has_any_column_privilege
    has_schema_privilege has_database_privilege has_function_privilege has_sequence_privilege
    has_type_privilege has_tablespace_privilege has_foreign_data_wrapper_privilege
    has_server_privilege has_language_privilege has_parameter_privilege pg_has_role
    pg_encoding_to_char pg_char_to_encoding pg_encoding_max_length getdatabaseencoding
    pg_client_encoding pg_tablespace_location pg_relation_size pg_total_relation_size
    pg_table_size pg_indexes_size pg_database_size pg_tablespace_size pg_size_pretty pg_size_bytes
    pg_relation_is_updatable
    pg_column_is_updatable pg_column_size pg_index_column_has_property pg_index_has_property
    pg_indexam_has_property pg_options_to_table pg_sequence_parameters pg_typeof
    pg_partition_tree pg_partition_root pg_partition_ancestors pg_is_in_recovery
    pg_my_temp_schema pg_is_other_temp_schema pg_jit_available pg_trigger_depth
    pg_postmaster_start_time pg_conf_load_time pg_backend_pid pg_listening_channels
    current_setting set_config version current_database current_schema current_schemas
    current_catalog current_user session_user current_role user inet_server_addr
    inet_server_port inet_client_addr inet_client_port to_regclass to_regtype to_regproc
    to_regprocedure to_regnamespace to_regrole to_regoper to_regoperator to_regcollation
    array_in array_out textin textout int2vectorout oidvectortypes
"""

_GENERAL_FUNCTIONS = """
    count sum avg min max bool_and bool_or every array_agg string_agg json_agg jsonb_agg
    json_object_agg jsonb_object_agg row_number rank dense_rank percent_rank cume_dist lag lead
    first_value last_value nth_value ntile coalesce nullif greatest least lower upper initcap
    length char_length character_length octet_length bit_length substring substr position strpos
    overlay replace translate trim btrim ltrim rtrim lpad rpad left right concat concat_ws
    split_part starts_with reverse md5 regexp_replace regexp_match regexp_matches
    regexp_split_to_array regexp_split_to_table regexp_like regexp_count regexp_substr
    regexp_instr like_escape string_to_array array_to_string array_length array_lower
    array_upper array_dims array_ndims array_position array_positions array_append
    array_prepend array_cat array_remove array_replace cardinality unnest generate_series
    generate_subscripts to_char to_number to_date to_timestamp now statement_timestamp
    transaction_timestamp clock_timestamp date_part date_trunc extract age make_date abs round
    ceil ceiling floor trunc mod sign power sqrt div exp ln log chr ascii encode decode to_hex
    row_to_json to_json to_jsonb json_build_object jsonb_build_object json_build_array
    jsonb_build_array json_extract_path_text jsonb_extract_path_text json_array_elements
    jsonb_array_elements json_each jsonb_each json_typeof jsonb_typeof jsonb_pretty
    array_to_json quote_ident quote_literal quote_nullable parse_ident format localtime localtimestamp
    current_date current_time current_timestamp
"""

#: Bounded by the shadow's statement timeout (clients' own timeout tests use it).
_BOUNDED_FUNCTIONS = "pg_sleep"

ALLOWED_FUNCTIONS = _words(_TYPES + _CATALOG_FUNCTIONS + _GENERAL_FUNCTIONS + _BOUNDED_FUNCTIONS)

#: ``set_config(name, …)`` is allowed for these settings only (what clients set, nothing that
#: loosens the shadow's own limits such as statement_timeout or default_transaction_read_only).
SAFE_SETTINGS = _words(
    """
    application_name search_path datestyle intervalstyle timezone extra_float_digits
    client_min_messages bytea_output client_encoding standard_conforming_strings lc_monetary
    lc_numeric lc_time default_text_search_config
    """
)

#: Views that show other sessions, the server's configuration files or its activity.
_DENIED_RELATIONS = _words(
    """
    pg_stat_activity pg_locks pg_prepared_xacts pg_file_settings pg_hba_file_rules
    pg_ident_file_mappings pg_backend_memory_contexts pg_shmem_allocations pg_authid pg_shadow
    pg_largeobject pg_replication_slots
    pg_replication_origin_status pg_stat_statements pg_stat_statements_info
    """
)
#: ``pg_stat_*``/``pg_statio_*`` are refused except these (empty policy tables: nothing to see).
_ALLOWED_STAT_VIEWS = _words("pg_stat_user_tables pg_statio_user_tables pg_stat_user_indexes pg_statio_user_indexes")


def denied_relation(name: str) -> bool:
    if name in _DENIED_RELATIONS:
        return True
    return name.startswith(("pg_stat_", "pg_statio_")) and name not in _ALLOWED_STAT_VIEWS


def _string_value(tok: Token) -> str | None:
    if tok.type is not Lexeme.STRING or not tok.text.startswith("'"):
        return None
    return tok.value


def _closing(toks: list[Token], open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(toks)):
        if toks[j].symbol("("):
            depth += 1
        elif toks[j].symbol(")"):
            depth -= 1
            if depth == 0:
                return j
    return len(toks)


def _is_cte_columns(toks: list[Token], open_at: int) -> bool:
    """``name(a, b) AS (`` / ``AS MATERIALIZED`` / ``AS NOT MATERIALIZED``: a CTE's column list."""
    j = _closing(toks, open_at) + 1
    return (
        j + 1 < len(toks)
        and toks[j].word == "as"
        and (toks[j + 1].text == "(" or toks[j + 1].text in ("materialized", "not"))
    )


_HINT = (
    "Statements that name no policy table are answered by dpsql's schema-only catalog, which "
    "runs catalog reads and harmless functions only. DP queries must name a policy table."
)


def refuse_function(name: str) -> Error:
    return InsufficientPrivilege(
        f"permission denied for function {name}",
        detail="dpsql's catalog connection allows catalog introspection and formatting functions only.",
        hint=_HINT,
    )


def check_catalog_sql(sql: str) -> bool:
    """Raise a 42501 :class:`Error` unless ``sql`` only calls allowed functions on allowed relations.

    Returns whether it calls ``set_config`` (the connection's settings must then be reset after it:
    the pooled connection serves every analyst next)."""
    toks = catalog_tokens(sql)
    sets = False
    for i, tok in enumerate(toks):
        if tok.type not in (Lexeme.WORD, Lexeme.QUOTED_IDENT):
            continue
        name = tok.value
        is_call = i + 1 < len(toks) and toks[i + 1].symbol("(")
        if not is_call:
            if denied_relation(name.lower()):
                raise InsufficientPrivilege(
                    f"permission denied for view {name}",
                    detail="Other sessions and the server's activity are not visible through dpsql.",
                    hint=_HINT,
                )
            continue
        prev = toks[i - 1] if i else None
        qualified = prev is not None and prev.symbol(".")
        if tok.word and not qualified and tok.text in _SYNTAX:
            continue
        if prev is not None and not qualified:
            if prev.word in ("as", "ordinality"):
                continue  # alias column list, or a type modifier in CAST(x AS numeric(10, 2))
            if prev.symbol(")") or prev.symbol(":"):
                continue  # f(x) alias(a, b), or x::varchar(10)
        if _is_cte_columns(toks, i + 1):
            continue
        schema = toks[i - 2].value.lower() if qualified and i >= 2 else None
        if schema == "information_schema" and name.startswith("_pg_"):
            continue
        if schema not in (None, "pg_catalog") or name not in ALLOWED_FUNCTIONS:
            shown = f"{toks[i - 2].value}.{name}" if qualified and i >= 2 else name
            raise refuse_function(shown)
        if name == "set_config":
            sets = True
            setting = _string_value(toks[i + 2]) if i + 2 < len(toks) else None
            if setting is None or setting.lower() not in SAFE_SETTINGS:
                raise InsufficientPrivilege(
                    f"permission denied to set parameter {setting!r} on the catalog connection"
                    if setting is not None
                    else "set_config() on the catalog connection needs a literal parameter name",
                    hint="Only client-presentation settings (search_path, DateStyle, application_name…) "
                    "may be changed there.",
                )
    return sets


#: :func:`check_catalog_sql`'s verdict as plain data (it crosses from the statement-splitting helper
#: process): ("ok", sets) or ("error", (class name, message, detail, hint)).
Verdict = tuple[str, object]


def vet(sql: str) -> Verdict:
    """:func:`check_catalog_sql` as data: a long statement is vetted in the helper process (a pure
    Python scan of 250 kB holds the GIL ~0.3 s), and :func:`replay` gives the same outcome later."""
    try:
        return "ok", check_catalog_sql(sql)
    except Error as exc:
        return "error", (type(exc).__name__, exc.message, exc.detail, exc.hint)


def replay(verdict: Verdict) -> bool:
    """The outcome of :func:`vet` for the same text: whether it calls set_config, or its error."""
    status, value = verdict
    if status == "ok":
        return bool(value)
    assert isinstance(value, tuple) and len(value) == 4
    name, message, detail, hint = (None if v is None else str(v) for v in value)
    cls = getattr(errors, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, Error)):
        cls = InsufficientPrivilege
    raise cls(message or "permission denied", detail=detail, hint=hint)
