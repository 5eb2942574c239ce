{{/* Names and labels. */}}
{{- define "tritonguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tritonguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tritonguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tritonguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tritonguard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tritonguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tritonguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tritonguard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository[:tag] or repository@digest of an image block {repository, tag, digest} */}}
{{- define "tritonguard.imageRef" -}}
{{- $img := index . 0 -}}{{- $default := index . 1 -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default $default $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "tritonguard.image" -}}
{{- include "tritonguard.imageRef" (list .Values.image .Chart.AppVersion) -}}
{{- end -}}

{{/* Where the model repository is inside the server's container. */}}
{{- define "tritonguard.dataDir" -}}/var/lib/tritonguard{{- end -}}

{{- define "tritonguard.repository" -}}
{{- if eq .Values.modelRepository.source "s3" -}}
{{- .Values.modelRepository.s3.url -}}
{{- else if eq .Values.modelRepository.source "pvc" -}}
{{- printf "%s/%s" (include "tritonguard.dataDir" .) .Values.modelRepository.pvc.subPath -}}
{{- else -}}
{{- printf "%s/models" (include "tritonguard.dataDir" .) -}}
{{- end -}}
{{- end -}}

{{/* one Job per model and version (a Job's spec cannot change); DNS-1123: no underscores */}}
{{- define "tritonguard.rolloutJob" -}}
{{- printf "%s-promote-%s-v%v" (include "tritonguard.fullname" .) (.Values.rollout.model | replace "_" "-" | replace "." "-" | lower) .Values.rollout.version | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tritonguard.pvcName" -}}
{{- default (printf "%s-models" (include "tritonguard.fullname" .)) .Values.modelRepository.pvc.existingClaim -}}
{{- end -}}

{{/* Secrets: names, and values generated once and read back on upgrade. */}}
{{- define "tritonguard.keysSecret" -}}
{{- default (printf "%s-keys" (include "tritonguard.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* external store: the Secret and key holding TRITONGUARD_STATE_URL */}}
{{- define "tritonguard.stateSecret" -}}
{{- default (printf "%s-state" (include "tritonguard.fullname" .)) .Values.store.external.existingSecret -}}
{{- end -}}

{{- define "tritonguard.stateSecretKey" -}}
{{- if .Values.store.external.existingSecret -}}
{{- .Values.store.external.existingSecretKey -}}
{{- else -}}url{{- end -}}
{{- end -}}

{{- define "tritonguard.redisName" -}}
{{- printf "%s-redis" (include "tritonguard.fullname" .) -}}
{{- end -}}

{{- define "tritonguard.redisSecret" -}}
{{- default (include "tritonguard.redisName" .) .Values.redis.existingSecret -}}
{{- end -}}

{{- define "tritonguard.objectStoreSecret" -}}
{{- default (printf "%s-object-store" (include "tritonguard.fullname" .)) .Values.modelRepository.s3.existingSecret -}}
{{- end -}}

{{/* (list $ secretName key explicitValue): the explicit value, else the one in the cluster's
     Secret (an upgrade keeps it), else 32 random characters (an install, or an offline render). */}}
{{- define "tritonguard.keepOrGenerate" -}}
{{- $root := index . 0 -}}{{- $name := index . 1 -}}{{- $key := index . 2 -}}{{- $explicit := index . 3 -}}
{{- if $explicit -}}
{{- $explicit -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace $name -}}
{{- if and $existing (hasKey $existing.data $key) -}}
{{- index $existing.data $key | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Every Triton API that changes the server (Triton 2.51's category names, the same through 2.73):
     client shared-memory registration (step two of CVE-2025-23319/-23320/-23334), model
     load/unload, model configs, trace and log settings. Health, metadata, inference and
     statistics stay open. */}}
{{- define "tritonguard.adminApis" -}}shared-memory,model-repository,model-config,trace,logging{{- end -}}

{{/* Environment shared by the server and the rollout Job: the store, the admin key, the guard
     secrets (each optional: a key missing from the Secret leaves the variable unset, which is
     what tritonguard reads as "not configured"). */}}
{{- define "tritonguard.commonEnv" -}}
{{- if eq .Values.store.mode "bundled" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.redisSecret" . }}
      key: password
- name: TRITONGUARD_STATE_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s.%s.svc:6379/0" (include "tritonguard.redisName" .) .Release.Namespace | quote }}
{{- else -}}
- name: TRITONGUARD_STATE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.stateSecret" . }}
      key: {{ include "tritonguard.stateSecretKey" . }}
{{- end }}
- name: TRITONGUARD_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.keysSecret" . }}
      key: admin-key
- name: TRITONGUARD_ADMIN_HEADER
  value: {{ .Values.adminApi.header | quote }}
- name: TRITONGUARD_TENANT_JWT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.keysSecret" . }}
      key: tenant-jwt-secret
      optional: true
- name: TRITONGUARD_L2_ENCRYPTION_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.keysSecret" . }}
      key: cache-encryption-key
      optional: true
- name: TRITONGUARD_AUDIT_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "tritonguard.keysSecret" . }}
      key: audit-key
      optional: true
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end -}}

{{- define "tritonguard.podAntiAffinity" -}}
{{- if .Values.affinity -}}
{{- toYaml .Values.affinity -}}
{{- else if eq .Values.podAntiAffinity "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "tritonguard.selectorLabels" . | nindent 10 }}
          app.kubernetes.io/component: server
{{- else if eq .Values.podAntiAffinity "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "tritonguard.selectorLabels" . | nindent 12 }}
            app.kubernetes.io/component: server
{{- end -}}
{{- end -}}
